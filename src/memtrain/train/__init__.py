"""A run: preflight, the launcher, the step loop, model checkpoints and resume, metrics, stop signals, faults."""
