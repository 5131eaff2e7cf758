"""The model and its inputs: build from config, local data, FLOPs."""
