"""Faults: a kill in the middle of a save, a NaN loss, an out-of-memory error."""
import json
import re

import torch

from conftest import ROOT
from memtrain.train.faults import RunPosition, is_oom, oom_message, write_failure
from memtrain.train.run_dir import RunDir
from memtrain.config.recipe import load_recipe


def test_out_of_memory_report(tmp_path):
    try:
        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the real CPU allocator refuses
        raise AssertionError("allocation of 1 PiB succeeded")
    except RuntimeError as e:
        error = e
    assert is_oom(error) and not is_oom(RuntimeError("shape mismatch"))
    recipe = load_recipe(None, ["train.micro_batch_size=4"])
    progress = RunPosition(world=2, rank=1, run_dir=RunDir(tmp_path), step=6)
    line = oom_message(progress, recipe, json.loads((ROOT / "ds_configs" / "zero3_ckpt.json").read_text()))
    assert "\n" not in line
    assert re.match(r"out of memory at step 7 on rank 1: peak host RSS \d+\.\d\d GiB of \d+\.\d\d GiB \(host RAM|"
                    r"cgroup limit, /sys/fs/cgroup/[\w./]+\); ", line), line
    assert "train.micro_batch_size (now 4)" in line or "planner:" in line
    write_failure(progress, "oom", line)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "oom" and summary["reason"] == line and summary["steps"] == 6
