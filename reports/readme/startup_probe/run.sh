#!/bin/bash
# make train's two commands (Makefile: train) on 2 CPU ranks, with this folder's sitecustomize recording when each
# process starts and each phase of rank 0 begins and ends: OUT/probe/<pid>.txt, OUT/t0, OUT/run.log.
# Usage, from the repository root: reports/readme/startup_probe/run.sh OUT [train.py flags], then phases.py OUT...
# CUDA_VISIBLE_DEVICES="" in the environment takes the launch through DeepSpeed's runner and launch.py (the "before").
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=$1; shift
mkdir -p "$OUT/probe"
export STARTUP_PROBE_OUT=$OUT/probe PYTHONPATH=$PWD/src:$HERE
T0=$(date +%s.%N); echo "$T0" > "$OUT/t0"
{ .venv/bin/python -m memtrain preflight --world-size 2 "$@"
  .venv/bin/python -m memtrain.train.launch --quiet --num_gpus 2 src/train.py "$@"; } > "$OUT/run.log" 2>&1
