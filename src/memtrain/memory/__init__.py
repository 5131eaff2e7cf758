"""Memory and FLOPs: the peak-memory estimate, the `auto` planner, FLOPs per token."""
