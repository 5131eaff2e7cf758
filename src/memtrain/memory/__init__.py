"""Memory and FLOPs, measured and predicted: model states, a step's peak for any plan, the `auto` planner,
FLOPs per token, step time and the whole-configuration search."""
