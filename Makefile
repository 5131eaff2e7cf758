# memtrain: `make train` and `make test` set everything up on a fresh machine.
PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
NPROC   ?= 2
RECIPE  ?=
DS      ?= ds_configs/zero3_ckpt.json
ARGS    ?=
export PATH := $(abspath $(BIN)):$(PATH)
export PYTHONPATH := $(abspath src)
export PYTHONWARNINGS := ignore::FutureWarning

RECIPE_ARG := $(if $(RECIPE),--recipe $(RECIPE),)

.PHONY: setup train test clean

setup: $(VENV)/.installed

# Pinned environment. torch==2.13.0 resolves to the CPU build on this kind of machine.
# The shm comm op DeepSpeed JIT-builds on CPU is built once here, not inside the first run.
$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	$(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 || true
	touch $@

## train: the embedded default job (tiny Llama, stdlib text, 2 CPU ranks, ZeRO-3 + full AC)
train: setup
	$(BIN)/deepspeed --num_gpus $(NPROC) src/train.py --deepspeed $(DS) $(RECIPE_ARG) $(ARGS)

## test: the whole suite (CPU)
test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf runs reports .cache
