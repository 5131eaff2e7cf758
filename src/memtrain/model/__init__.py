"""The model and its inputs: the model built from config or pretrained weights, its loss, tokenizers, and
the rows a run reads."""
import logging

# bitsandbytes (which peft imports where it is installed) warns at import, on CPUs with AVX512-BF16, that an
# optional package of faster CPU kernels (`kernels`) is absent; its own CPU path runs without it
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
