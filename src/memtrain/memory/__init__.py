"""Memory: the activation tracker, the peak-memory estimate, the `auto` planner."""
