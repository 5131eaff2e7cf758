"""Activation recompute: policies, the hooks that install them, offload of checkpointed inputs, the meter
that counts what a plan saves."""
