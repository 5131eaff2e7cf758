"""The model and its inputs: the model built from config or pretrained weights, its loss, tokenizers, and
the rows a run reads."""
