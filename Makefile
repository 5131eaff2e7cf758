# memtrain: `make train` and `make test` set everything up on a fresh machine.
PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
NPROC   ?= 2
TEST_WORKERS ?= 2
RECIPE  ?=
DS      ?=
ARGS    ?=
SWEEP   ?= recipes/sweeps/tiny-cpu.yaml
SWEEP_ARGS ?=
DATA_SIZES ?= 0.1,0.5,2
FORCE   ?=
LAUNCHER ?=
BUDGET  ?=
NODES   ?= 1
GPUS    ?= 0
TIME    ?=
PARTITION ?=
ACCOUNT ?=
NGPUS   ?=
DEVICE  ?=
export PATH := $(abspath $(BIN)):$(PATH)
export PYTHONPATH := $(abspath src)
export PYTHONWARNINGS := ignore::FutureWarning
# DeepSpeed JIT-builds ops (the CPU shm comm op) into this cache; one per venv, so two checkouts never
# keep invalidating each other's build.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions

RECIPE_ARG := $(if $(RECIPE),--recipe "$(RECIPE)",)
# no DS: the tools' default JSON (ds_configs/zero3_ckpt.json), or with --resume the run's own
DS_ARG := $(if $(DS),--deepspeed "$(DS)",)

.PHONY: setup train test test-fast test-multinode clean sweep report ac-profile slurm-submit test-slurm bench bench-host bench-plan bench-data gpu-check gpu-wheels plan explain

setup: $(VENV)/.installed

# Pinned environment. torch==2.13.0 resolves to the CPU build on this kind of machine.
# Nothing is JIT-built, here or at launch: the trainer tells DeepSpeed to skip its CPU shm comm op
# (inference-only) and uses torch's AdamW.
# uv (pinned) installs the same pins as pip, in parallel: 25 s (its cache warm) against pip's 103 s on a fresh clone here
# (reports/readme/test-times.md). uv does not read pip's configuration, so pip's find-links (where a machine keeps
# its local wheels, e.g. the CPU torch) are passed on. --compile-bytecode: pip writes the .pyc files at install, uv
# does not by default; where PYTHONDONTWRITEBYTECODE is set (as on this machine) every process would compile
# torch, transformers and DeepSpeed from source again (an import 10.1 CPU-s instead of 4.4).
UV_VERSION := 0.13.9
PIP_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python $(foreach l,$(PIP_LINKS),--find-links $(l)) -r requirements.lock
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps -e .
	touch $@

## train: the embedded default job (tiny Llama, stdlib text, 2 CPU ranks, ZeRO-3 + full AC)
# Inputs are checked (and the corpus packed) in one plain process first: a mistake is one line
# and no launcher or worker starts. The launcher is DeepSpeed's runner inside memtrain.train.launch: Ctrl-C or a
# SIGTERM to it reaches every rank, which saves and exits, with no traceback; it names DeepSpeed's accelerator
# for itself and the ranks (its auto-detection logs a warning in each launcher process; memtrain.errors).
train: setup
	$(BIN)/python -m memtrain preflight --world-size $(NPROC) $(DS_ARG) $(RECIPE_ARG) $(ARGS)
	$(BIN)/python -m memtrain.train.launch --quiet --num_gpus $(NPROC) src/train.py $(DS_ARG) $(RECIPE_ARG) $(ARGS)

## sweep: every point of SWEEP's grid, one launcher process each, under runs/<sweep>/ (FORCE=1: rerun finished points;
## SWEEP_ARGS="--set train.max_steps=10 --grid train.micro_batch_size=4": a smaller sweep, under runs/<sweep>-<hash>/)
sweep: setup
	$(BIN)/python -m memtrain sweep "$(SWEEP)" $(if $(filter 1 yes true,$(FORCE)),--force) $(if $(LAUNCHER),--launcher $(LAUNCHER)) $(SWEEP_ARGS)

## report: SWEEP's runs (TensorBoard) -> reports/<sweep>/summary.{md,csv} + plots; BUDGET=40GiB names the best point that fits
report: setup
	$(BIN)/python -m memtrain report "$(SWEEP)" $(if $(BUDGET),--budget="$(BUDGET)") $(SWEEP_ARGS)

## ac-profile: one measured CPU step per AC policy on RECIPE's model -> table + reports/ac_profile.csv (ARGS: e.g. --policies full,op)
ac-profile: setup
	$(BIN)/python -m memtrain ac-profile $(RECIPE_ARG) $(ARGS)

## plan: predicted peak memory per device of RECIPE under DS, per AC policy (fake tensors: seconds on CPU);
## BUDGET=40GiB adds max micro-batch/sequence and the auto plan; NGPUS= world size; DEVICE=cuda plans for GPUs; ARGS: --json
plan: setup
	$(BIN)/python -m memtrain plan $(DS_ARG) $(RECIPE_ARG) $(if $(BUDGET),--budget="$(BUDGET)") \
	  $(if $(NGPUS),--ngpus $(NGPUS)) $(if $(DEVICE),--device $(DEVICE)) $(ARGS)

## explain: one line per key of DS (a DeepSpeed JSON) under RECIPE: filled from the recipe, in effect, a no-op here, or rejected
explain: setup
	$(BIN)/python -m memtrain explain-config --world-size $(NPROC) $(DS_ARG) $(RECIPE_ARG) $(ARGS)

## slurm-submit: slurm/train.sbatch on NODES whole nodes x GPUS GPUs (GPUS=0: NPROC CPU ranks per node); TIME= PARTITION= ACCOUNT= optional
slurm-submit: setup
	mkdir -p runs
	$(if $(filter 0,$(GPUS)),NPROC_PER_NODE=$(NPROC)) sbatch --nodes=$(NODES) \
	  $(if $(filter 0,$(GPUS)),--cpus-per-task=$(NPROC),--gpus-per-node=$(GPUS) --exclusive) \
	  $(if $(TIME),--time=$(TIME)) $(if $(PARTITION),--partition=$(PARTITION)) $(if $(ACCOUNT),--account=$(ACCOUNT)) \
	  slurm/train.sbatch $(or $(RECIPE),tiny) $(or $(DS),ds_configs/zero3_ckpt.json) $(ARGS)

## test-slurm: the Slurm tests alone (slurm/local/up.sh installs and starts a local Slurm); also in `make test-multinode`
test-slurm: setup
	$(BIN)/python -m pytest -q tests/launch/test_slurm.py $(PYTEST_ARGS)

## bench: recompute/offload set-ups side by side on one GPU, one process each (RECIPE: shape, default llama-1b;
## ARGS: e.g. --setups torch:noac,memtrain:full+offload --no-search); without a GPU: says so, tiny CPU smoke run, exit 0
bench: setup
	$(BIN)/python -m memtrain bench $(RECIPE_ARG) $(ARGS)

## bench-host: host work per step (ZeRO-3 fetches, all-gathers, aten ops, CPU time) of the trainer beside plain PyTorch,
## tiny recipe on one CPU core -> reports/host_overhead.{md,json,png} (ARGS: e.g. --setups torch:noac,memtrain:full)
bench-host: setup
	$(BIN)/python -m memtrain bench-host $(ARGS)

## bench-plan: configurations `make plan --search` scores per second on one core -> reports/plan_search.md (ARGS: --recipe ...)
bench-plan: setup
	$(BIN)/python -m memtrain bench-plan $(ARGS)

## bench-data: token store builds of synthetic corpora (DATA_SIZES GB, default 0.1,0.5,2), byte and a local BPE
## tokenizer, 1 and 2 workers: MB/s, peak RSS, a new seq_len's time to its first batch -> reports/data_prep.{md,json}
bench-data: setup
	$(BIN)/python -m memtrain bench-data --sizes "$(DATA_SIZES)" $(ARGS)

## gpu-check: the GPU acceptance run (llama-1b, seq 2048, bf16, 30 steps per set-up: none, full, full+offload, op,
## auto at half of none's peak, plain PyTorch) -> reports/gpu/<device>.md, then long sequences (llama-8b-long at 256K,
## qwen2-1.5b-long at 1M, fused vs standard at 8K) -> reports/gpu/<device>-long.md; without a GPU: one line, exit 0
gpu-check: setup
	$(BIN)/python -m memtrain gpu-check $(ARGS)

## gpu-wheels: .whl/ holds what a GPU image with its own CUDA torch (>= 2.11) lacks, at requirements.lock's pins:
## DeepSpeed (a pure-python wheel; ops JIT-build there), datasets, transformers and their missing dependencies, for
## CPython 3.12 (WHEEL_PY). On the GPU machine: pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
## && PYTHONPATH=$$PWD/src:/tmp/site python3 -m memtrain.tools.bench --gpu-check (docs/offload-and-benchmarks.md)
WHEEL_PY ?= 3.12
GPU_WHEELS := datasets transformers regex hjson pydantic pydantic_core annotated-types typing-inspection typing_extensions \
              dill multiprocess
gpu-wheels: setup
	rm -rf .whl && mkdir -p .whl
	DS_BUILD_OPS=0 $(BIN)/pip wheel -q --disable-pip-version-check --no-deps -w .whl \
	  $$(grep -i '^deepspeed==' requirements.lock)
	$(BIN)/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version $(WHEEL_PY) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl \
	  $$(for p in $(GPU_WHEELS); do grep -i "^$$p==" requirements.lock; done)
	@ls .whl && du -sh .whl

## test: the whole suite (CPU): tests/unit (in process) and tests/launch (the real launcher, subprocess runs), its files
## spread over TEST_WORKERS pytest-xdist workers (0: in one process), whole files, the longest first
## (tests/file_order.py: seconds per file in tests/file_seconds.json)
test: setup
	$(BIN)/ruff check -q src tests
	$(BIN)/python -m pytest -q -m "not multinode" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

## test-fast: the unit tier alone (tests/unit: in process, no launcher, no subprocess run), over TEST_WORKERS workers
test-fast: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests/unit $(PYTEST_ARGS)

## test-multinode: two torchrun agents as two nodes on this machine (tests/launch/test_multinode.py) and the Slurm
## lost-rank job; .ci/run runs it after make test. Its 4 tests run at once, one xdist worker each: run one by one,
## the cores sat partly idle (the same CPU-s took 1.6x the wall; reports/readme/test-times.md)
MULTINODE_WORKERS ?= 4
test-multinode: setup
	$(BIN)/python -m pytest -q -m multinode -n $(MULTINODE_WORKERS) --dist load \
	  tests/launch/test_multinode.py tests/launch/test_slurm.py $(PYTEST_ARGS)

clean:
	rm -rf runs .cache
	find reports -mindepth 1 -maxdepth 1 ! -name readme ! -name .keep -exec rm -rf {} + 2>/dev/null || true
