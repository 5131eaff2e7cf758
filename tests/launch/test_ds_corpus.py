"""The DeepSpeed JSONs users bring (tests/ds_corpus/: transformers', accelerate's, LLaMA-Factory's,
axolotl's, DeepSpeedExamples', LLaVA's, InternVL's styles): each one either trains, or is rejected
with one line naming the key before any worker starts. Nothing is left to a traceback.

Every file goes through the full preflight in this process (cheap: no launcher). Trained through
the real launcher on 2 CPU ranks, the three runs in one launch (a launch costs ~30 s here, so only these):
- noopt_zero3_ac.json and auto_everywhere_ac.json: the same job without and with optimizer/scheduler
  sections. memtrain's own AdamW + schedule must give DeepSpeed's own AdamW + WarmupCosineLR losses.
- accelerate_zero2_noopt.json: ZeRO-2 without an optimizer ("zero stage 2 requires an optimizer").
The other "train" files were trained the same way by hand, 2 steps on 2 CPU ranks (2026-11-23, this
2-core box): llamafactory_ds_z0 (ZeRO-0), llamafactory_ds_z3 (ZeRO-3), axolotl_zero3_bf16 (bf16),
megatron_ac_contiguous (DeepSpeed's checkpoint with contiguous_memory_optimization), internvl_zero1,
dse_zero2_explicit. The two CPU-offload ones pass preflight but are not trained here: an offloaded
optimizer needs DeepSpeed's CPU Adam, a JIT build of minutes (preflight warns of it up front).
"""
import json

import deepspeed  # noqa: F401  imported before any capsys: its logger keeps the stream it first sees
import pytest

from conftest import FAST, ROOT, assert_ok
from memtrain.config.args import parse_args
from memtrain.config.ds_config import auto_paths
from memtrain.tools.tb import read_scalars
from trainer_runs import run_in_one_launch

CORPUS = ROOT / "tests" / "ds_corpus"
STEPS = ["--max-steps", "3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The three runs in one launch (tests/trainer_runs.py), each with its slice of the launch's output."""
    names = ("noopt_zero3_ac.json", "auto_everywhere_ac.json", "accelerate_zero2_noopt.json")
    run_dirs, steps = [], []
    for name in names:
        run_dir = tmp_path_factory.mktemp(name.split(".")[0]) / "run"
        save = ["--set", "train.save_interval=2"] if name.startswith("noopt") else []  # step 2 for the export test
        # a larger lr than the default: the first warm-up update has lr 0, so the second must move the loss
        save += ["--set", "train.lr=0.03"] if name != "accelerate_zero2_noopt.json" else []
        run_dirs.append(run_dir)
        steps.append({"argv": ["--deepspeed", str(CORPUS / name), "--run-dir", str(run_dir), *FAST, *STEPS, *save]})
    procs = run_in_one_launch(steps, tmp_path_factory.mktemp("runs") / "runs.json")
    assert_ok(procs[-1])
    return {name: (run_dir, proc) for name, run_dir, proc in zip(names, run_dirs, procs)}


def _losses(run_dir):
    return [v for _, v in read_scalars(run_dir / "tb")["train/loss"]]


def test_own_optimizer_matches_deepspeeds(trained):
    """No sections: memtrain's AdamW + warm-up/cosine. Sections with "auto": DeepSpeed builds them.
    The two runs must see the same losses step after step (updates 1 and 2 shape steps 2 and 3)."""
    own, ds = _losses(trained["noopt_zero3_ac.json"][0]), _losses(trained["auto_everywhere_ac.json"][0])
    assert len(own) == len(ds) == 3
    assert own == pytest.approx(ds, rel=1e-5, abs=1e-6)
    assert own[2] != pytest.approx(own[0], abs=1e-4)  # the updates did change something
    own_lr = [v for _, v in read_scalars(trained["noopt_zero3_ac.json"][0] / "tb")["train/lr"]]
    ds_lr = [v for _, v in read_scalars(trained["auto_everywhere_ac.json"][0] / "tb")["train/lr"]]
    assert own_lr == pytest.approx(ds_lr)


def test_runs_are_quiet_and_recorded(trained):
    for name, (run_dir, proc) in trained.items():
        worker_lines = [line for line in (proc.stdout + proc.stderr).splitlines()
                        if "[WARNING]" in line or "[INFO]" in line]
        # the launcher's own lines (runner.py, launch.py) come before memtrain runs; none from the workers
        assert all("launch.py" in line or "runner.py" in line or "real_accelerator" in line
                   for line in worker_lines), worker_lines
        assert "Writing model shards" not in proc.stdout + proc.stderr  # final/ is written quietly
        # one writer per log file: rank 0 the run's deepspeed.log, rank 1 its own
        assert "[rank 1]" not in (run_dir / "deepspeed.log").read_text()
        assert "[rank 1]" in (run_dir / "logs" / "deepspeed.rank1.log").read_text()
        config = json.loads((run_dir / "config.json").read_text())["deepspeed"]
        assert auto_paths(config) == [], name
        if name.startswith("noopt"):  # what memtrain built for the missing sections is on record
            record = json.loads((run_dir / "config.json").read_text())
            assert record["memtrain_optimizer"]["params"]["lr"] == 0.03
            assert record["memtrain_scheduler"]["params"]["warmup_type"] == "linear"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["skipped_steps"] == 0
        tags = read_scalars(run_dir / "tb")
        assert [v for _, v in tags["train/skipped_steps"]] == [0.0, 0.0, 0.0]
    # DeepSpeed's "total_num_steps 3 is less than warmup_num_steps 4" went to the file, not the console
    assert "warmup_num_steps" in (trained["auto_everywhere_ac.json"][0] / "deepspeed.log").read_text()


def test_final_and_export_load_with_transformers(trained, capsys):
    """`memtrain export RUN --step 2` loads with transformers and gives the loss the run logged at
    step 3 (computed on the weights after 2 updates, over both ranks' batches); final/ (gathered
    ZeRO-3 weights at the end) equals the export of the last checkpoint; the tokenizer round-trips.
    The export runs in this process, through `python -m memtrain`'s own entry point (no launch of its own)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memtrain.__main__ import main
    from memtrain.model.data import prepare_data

    run_dir = trained["noopt_zero3_ac.json"][0]
    exported = {}
    for step in (2, 3):
        main(["export", str(run_dir), "--step", str(step)])
        exported[step] = AutoModelForCausalLM.from_pretrained(capsys.readouterr().out.strip().splitlines()[-1]).eval()
    recipe = parse_args(["--deepspeed", str(CORPUS / "noopt_zero3_ac.json"), *FAST, *STEPS]).recipe
    t = recipe.train
    data = prepare_data(recipe.data, t.seed, build=False)
    with torch.no_grad():
        losses = [exported[2](input_ids=ids, labels=ids).loss.item()
                  for ids in (data.batch(2, 0, rank, 2, t.micro_batch_size, t.grad_accum_steps) for rank in (0, 1))]
    logged = dict(read_scalars(run_dir / "tb")["train/loss"])[3]
    assert sum(losses) / 2 == pytest.approx(logged, rel=1e-4)

    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert (run_dir / "final" / "model.safetensors").is_file()
    last = exported[3].state_dict()
    for name, value in final.state_dict().items():
        torch.testing.assert_close(value.float(), last[name].float(), msg=name)
    tok = AutoTokenizer.from_pretrained(run_dir / "final")
    assert tok("héllo")["input_ids"] == list("héllo".encode()) and tok.eos_token_id == 256
