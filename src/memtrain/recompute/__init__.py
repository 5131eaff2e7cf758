"""Activation recompute: policies, the hooks that install them, offload of checkpointed inputs."""
