"""What to run: the recipe, the DeepSpeed JSON, the command line."""
