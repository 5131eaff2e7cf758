"""A run: preflight, the step loop, model checkpoints, metrics, faults."""
