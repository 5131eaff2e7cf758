"""Nothing of an earlier run is lost: `--overwrite` with a mistake, a failure or a kill, and `--resume` of a
damaged or finished run directory. Single-process `python src/train.py` runs: the launcher adds nothing here.

Every comparison is against a snapshot (sha256 of every file) taken before the mistake, and resumed
losses are compared with the losses the uninterrupted run logged, read back from TensorBoard.
"""
import hashlib
import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import (_engine_step_hook_env, kill_in_save_env, FAST, ROOT, TRAIN, Launch, _env, assert_ok, launch_cmd,
                      run_train)
from memtrain.config.args import parse_args
from memtrain.errors import UserError
from memtrain.tools.tb import read_scalars
from memtrain.train.checkpoint import tag_for
from memtrain.train.preflight import resolve_run

RUN_ARGS = [*FAST, "--max-steps", "4", "--set", "train.save_interval=2"]


def _snapshot(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run with model checkpoints at steps 2 and 4 (kept read-only: tests copy it)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert_ok(run_train([*RUN_ARGS, "--run-dir", str(run)]))
    return run


def _copy(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    return run


# One process tries every mistake in turn through the real entry point (src/train.py's main); each is
# caught before distributed start-up except the last (data shorter than one sequence, found when packing).
MISTAKES = textwrap.dedent("""
    import contextlib, io, json, sys
    from memtrain.train.main import main
    out = []
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                main(argv)
                code = 0
            except SystemExit as e:
                code = e.code
        out.append([code, err.getvalue().strip().splitlines()])
    print(json.dumps(out))
""")


def test_overwrite_with_a_mistake_changes_nothing(finished, tmp_path):
    run = _copy(finished, tmp_path)
    before = _snapshot(run)
    binary = tmp_path / "corpus.txt"
    binary.write_bytes(b"text\0\x01\x02")
    latin = tmp_path / "ds.json"
    latin.write_bytes((ROOT / "ds_configs" / "zero3_ckpt.json").read_bytes().replace(b"}", b"} \xe9", 1))
    offset = latin.read_bytes().index(b"\xe9")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("far too short for one sequence")
    s = lambda *pairs: [a for p in pairs for a in ("--set", p)]  # noqa: E731
    cases = [  # (argv, the exact error line)
        (s("activation_checkpointing.policy=modules", "activation_checkpointing.modules=[model.layers.*.mpl]"),
         "embedded recipe 'tiny': activation_checkpointing.modules: 'model.layers.*.mpl' matches no module of "
         "LlamaForCausalLM ('*' is one path part; e.g. model.layers.0.self_attn, model.layers.0.mlp, "
         "model.layers.0.input_layernorm, model.layers.0.post_attention_layernorm)"),
        (s("model.config.hidden_act=gelux"), "embedded recipe 'tiny': model.config.hidden_act: transformers cannot "
         "build llama with it: 'gelux' is not a name it knows; did you mean 'gelu'?"),
        (s(f"data.paths=[{binary}]"), f"embedded recipe 'tiny': data.paths: {binary}: binary data (a NUL byte at "
         "offset 4); expected text (.txt files are read as text)"),
        (["--deepspeed", str(latin)], f"{latin}: not UTF-8 text (byte 0xe9 at offset {offset}); a DeepSpeed config is "
         "JSON, which is UTF-8"),
        (["--max-steps", "abc"], "--max-steps: invalid int value: 'abc' (see src/train.py --help)"),
        (s("data.seq_len=1"), "embedded recipe 'tiny': data.seq_len: 1 leaves no next token to predict (the labels "
         "are the inputs shifted by one); expected 2 or more"),
        (s(f"data.cache_dir={blocker}/cache"), f"embedded recipe 'tiny': data.cache_dir: '{blocker}/cache' cannot be "
         f"created: '{blocker}' is a file, not a directory"),
        (["--resume"], "--overwrite: cannot be combined with --resume (resume continues a run, overwrite deletes it)"),
        (s(f"data.paths=[{short}]", f"data.cache_dir={tmp_path}/cache"),
         "data.paths: 1 file(s) hold 31 tokens, fewer than one sequence of data.seq_len=64"),
    ]
    argvs = [[*RUN_ARGS, *argv, "--run-dir", str(run), "--overwrite"] for argv, _ in cases]
    proc = subprocess.run([sys.executable, "-c", MISTAKES, json.dumps(argvs)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert_ok(proc)
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for (argv, line), (code, err) in zip(cases, results):
        assert (code, err) == (2, [f"memtrain: error: {line}"]), argv
    assert _snapshot(run) == before


def _poison_every_weight_after_step_1(tmp_path):
    """The env of a run whose weights all turn NaN in step 1's optimizer step (a sitecustomize: no test hook in the
    product's code): step 2's loss is NaN, whatever tokens it reads."""
    return _engine_step_hook_env(tmp_path, "poison-all", 1, (
        "for p in self.module.parameters():\n"
        "    (p.ds_tensor if getattr(p, 'ds_tensor', None) is not None else p.data).fill_(float('nan'))"))


def test_overwrite_that_fails_or_is_killed_before_its_first_checkpoint(finished, tmp_path):
    run = _copy(finished, tmp_path)
    before = _snapshot(run)
    # A run that fails before its first model checkpoint (weights turned NaN in step 1's update, so step 2's loss is
    # NaN and the run stops at step 2's boundary, before step 2's save): the earlier run comes back.
    nan = run_train([*RUN_ARGS, "--run-dir", str(run), "--overwrite"], env=_poison_every_weight_after_step_1(tmp_path))
    assert nan.returncode == 1 and "memtrain: error: loss is nan at step 2 of 4" in nan.stderr, nan.stderr[-3000:]
    assert _snapshot(run) == before

    # Killed in its first save: the earlier run is still on disk, whole, under .overwritten/ ...
    killed = run_train([*RUN_ARGS, "--run-dir", str(run), "--overwrite"], env=kill_in_save_env(tmp_path, 2))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert _snapshot(run / ".overwritten") == before
    with pytest.raises(UserError, match=r"--resume: no model checkpoint in .*; an interrupted --overwrite left the "
                                        r"earlier run in .*\.overwritten: move its entries back"):
        resolve_run(parse_args([*RUN_ARGS, "--run-dir", str(run), "--resume"]), 1)

    # ... until an --overwrite saves a model checkpoint: then, and only then, it is gone.
    assert_ok(run_train([*RUN_ARGS, "--set", "train.seed=7", "--run-dir", str(run), "--overwrite"]))
    assert not (run / ".overwritten").exists()
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert json.loads((run / "config.json").read_text())["recipe"]["train"]["seed"] == 7
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 1


def _resume_check(run, *extra, world=1):
    return resolve_run(parse_args([*RUN_ARGS, *extra, "--run-dir", str(run), "--resume"]), world)


def test_resume_refuses_or_falls_back_on_each_damaged_file(finished, tmp_path):
    """Each file of the run directory damaged in turn, checked by the preflight (as every worker does)."""
    shard = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    checks = {  # file damaged -> (how, warning or error expected)
        "config.json": lambda p: p.write_text(p.read_text()[:100]),  # not read to resume: still resumable
        f"checkpoints/{tag_for(4)}/{shard}": lambda p: p.write_bytes(p.read_bytes()[:5000]),
        f"checkpoints/{tag_for(4)}/zero_pp_rank_0_mp_rank_00_model_states.pt": lambda p: p.write_bytes(b""),
        f"checkpoints/{tag_for(4)}/rng_rank0.pt": lambda p: p.unlink(),
        "checkpoints/latest": lambda p: p.write_text("step00000009"),  # not read: the step directories decide
    }
    expected = {
        "config.json": None,
        f"checkpoints/{tag_for(4)}/{shard}": f"{shard} (truncated or corrupt (5000 bytes: File is not a zip file))",
        f"checkpoints/{tag_for(4)}/zero_pp_rank_0_mp_rank_00_model_states.pt":
            "zero_pp_rank_0_mp_rank_00_model_states.pt (empty)",
        f"checkpoints/{tag_for(4)}/rng_rank0.pt": "rng_rank0.pt (missing)",
        "checkpoints/latest": None,
    }
    for i, (name, damage) in enumerate(checks.items()):
        run = tmp_path / f"run{i}"
        shutil.copytree(finished, run)
        damage(run / name)
        if expected[name] is None:  # the newest checkpoint is intact: a finished run, refused as such
            with pytest.raises(UserError) as e:
                _resume_check(run)
            assert str(e.value) == (f"--resume: {run} has finished: summary.json says completed after 4 steps; its "
                                    "model checkpoint is at step 4 and train.max_steps is 4; its results are kept "
                                    "as they are (pass a larger --max-steps to train further, or use a new --run-dir)")
            continue
        warnings = _resume_check(run).warnings
        assert f"--resume: model checkpoint {run / 'checkpoints' / tag_for(4)} is damaged ({expected[name]}); " \
               f"skipped, resuming from {tag_for(2)}; it is moved to .damaged-{tag_for(4)}" in warnings, name

    run = tmp_path / "nothing-left"
    shutil.copytree(finished, run)
    (run / "checkpoints" / tag_for(2) / shard).write_bytes(b"")
    (run / "checkpoints" / tag_for(4) / shard).write_bytes(b"PK")
    with pytest.raises(UserError) as e:
        _resume_check(run)
    assert str(e.value) == (f"--resume: no intact model checkpoint in {run / 'checkpoints'}; the newest, "
                            f"{run / 'checkpoints' / tag_for(4)}, is damaged: {shard} (truncated or corrupt (2 bytes: "
                            "File is not a zip file)) (and 1 older ones)")

    run = tmp_path / "other-shape"
    shutil.copytree(finished, run)
    (run / "config.json").unlink()  # no saved inputs to compare with: the checkpoint's shapes are the check
    with pytest.raises(UserError) as e:
        _resume_check(run, "--max-steps", "6", "--set", "model.config.intermediate_size=256")
    assert str(e.value) == (f"--resume: {run / 'checkpoints' / tag_for(4)}/zero_pp_rank_0_mp_rank_00_model_states.pt:"
                            " 'model.layers.0.mlp.gate_proj.weight' has shape [352, 128] in the model checkpoint but "
                            "[256, 128] in this recipe's model; the recipe's model differs from the run's (model.*)")
    # another world size resumes through DeepSpeed's universal checkpoint (tests/launch/test_reshard.py), ZeRO-3 only
    with pytest.raises(UserError, match=r"was saved by 1 ranks, this launch has 2; .* ZeRO stage 3 only .* relaunch "
                                        "with 1"):
        _resume_check(run, "--max-steps", "6", "--deepspeed", str(ROOT / "ds_configs" / "zero2_ckpt.json"), world=2)


def test_resume_past_damaged_checkpoints_equals_the_run(finished, tmp_path):
    """Newest checkpoint truncated, an empty step directory above it, config.json cut: the resumed run
    continues from step 2 and recomputes steps 3-4 exactly; finished, it refuses to resume again."""
    run = _copy(finished, tmp_path)
    checkpoints = run / "checkpoints"
    shard = checkpoints / tag_for(4) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:5000])
    (checkpoints / tag_for(3)).mkdir()
    (run / "config.json").write_text((run / "config.json").read_text()[:100])
    with pytest.raises(json.JSONDecodeError) as cut:
        json.loads((run / "config.json").read_text())
    cut_error = str(cut.value)
    proc = run_train([*RUN_ARGS, "--run-dir", str(run), "--resume"])
    assert_ok(proc)
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning: --resume")]
    assert warnings == [
        f"warning: --resume: {run / 'config.json'} is damaged ({cut_error}), so the run's own recipe and JSON are "
        "unknown: this segment runs with this launch's flags as given, and config.json is rewritten from them",
        f"warning: --resume: model checkpoint {checkpoints / tag_for(4)} is damaged (zero_pp_rank_0_mp_rank_00_optim_states.pt "
        f"(truncated or corrupt (5000 bytes: File is not a zip file))); skipped, resuming from {tag_for(2)}; it is "
        f"moved to .damaged-{tag_for(4)}",
        f"warning: --resume: model checkpoint {checkpoints / tag_for(3)} is damaged (no model states file (the directory "
        f"holds no checkpoint file)); skipped, resuming from {tag_for(2)}; it is moved to .damaged-{tag_for(3)}"]
    assert (checkpoints / f".damaged-{tag_for(4)}" / shard.name).stat().st_size == 5000  # kept for inspection
    whole = dict(read_scalars(finished / "tb")["train/loss"])
    resumed = read_scalars(run / "tb")["train/loss"]
    assert [s for s, _ in resumed] == [1, 2, 3, 4]
    assert dict(resumed) == whole  # steps 3-4 recomputed exactly from the step-2 checkpoint
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4
    before = _snapshot(run)
    again = run_train([*RUN_ARGS, "--run-dir", str(run), "--resume"])
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"memtrain: error: --resume: {run} has finished: summary.json says completed after 4 steps; its model "
        "checkpoint is at step 4 and train.max_steps is 4; its results are kept as they are (pass a larger "
        "--max-steps to train further, or use a new --run-dir)"]
    assert _snapshot(run) == before


def test_a_run_stopped_on_its_last_step_without_a_summary_resumes_to_completion(finished, tmp_path):
    """Its last model checkpoint saved, summary.json not written (killed in final/) or removed (a sweep's rerun of a
    preempted point): --resume completes it (no step, final/ and summary.json); a completed run refuses."""
    run = _copy(finished, tmp_path)
    (run / "summary.json").unlink()
    shutil.rmtree(run / "final")
    assert _resume_check(run).plan is not None
    proc = run_train(["--run-dir", str(run), "--resume"])
    assert_ok(proc)
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert (run / "final" / "config.json").is_file()


def test_resume_continues_with_the_runs_saved_inputs(finished, tmp_path):
    """--resume alone takes the recipe and JSON the run was started with (not the defaults); flags given change them
    and are listed; a change to what the model checkpoints hold is one line, before anything is written."""
    run = _copy(finished, tmp_path)
    saved = json.loads((run / "config.json").read_text())
    ds_file = ROOT / "ds_configs" / "zero3_ckpt.json"
    assert saved["deepspeed_as_written"] == json.loads(ds_file.read_text()) and saved["earlier_segments"] == []

    alone = parse_args(["--run-dir", str(run), "--resume"])
    assert alone.recipe.model_dump(mode="json") == saved["recipe"]  # seq_len 64, 4 steps, save_interval 2: not defaults
    assert (alone.recipe.data.seq_len, alone.recipe.train.max_steps, alone.recipe.train.save_interval) == (64, 4, 2)
    assert alone.ds_config == saved["deepspeed_as_written"] and alone.resume_changes == ()
    assert resolve_run(parse_args(["--run-dir", str(run), "--resume", "--max-steps", "6"]), 1).plan is not None

    changed = parse_args(["--run-dir", str(run), "--resume", "--max-steps", "6", "--set", "train.lr=0.001"])
    assert changed.resume_changes == ("recipe: train.lr 0.003 -> 0.001", "recipe: train.max_steps 4 -> 6")
    assert (changed.recipe.train.max_steps, changed.recipe.data.seq_len) == (6, 64)
    dropout = parse_args(["--run-dir", str(run), "--resume", "--set", "model.config.attention_dropout=0.1"])
    assert dropout.resume_changes == ("recipe: model.config.attention_dropout (unset) -> 0.1",)  # no parameter changes
    same = parse_args([*RUN_ARGS, "--deepspeed", str(ds_file), "--run-dir", str(run), "--resume"])
    assert same.resume_changes == ()  # the flags repeated (as slurm/train.sbatch and sweeps do) change nothing

    before = _snapshot(run)
    refused = {
        ("--set", "model.lora.r=8"): "model.lora: (unset) -> {",
        ("--set", "train.trainable=[lm_head.weight]"): 'train.trainable: [] -> ["lm_head.weight"] (--set)',
        ("--deepspeed", str(ROOT / "ds_configs" / "zero2_ckpt.json")): "zero_optimization.stage: 3 -> 2 (--deepspeed)",
        ("--deepspeed", str(ROOT / "ds_configs" / "zero3_tp2_ckpt.json")):
            "tensor_parallel: (unset) -> {\"autotp_size\": 2} (--deepspeed)",
    }
    for flags, shown in refused.items():
        with pytest.raises(UserError) as e:
            parse_args(["--run-dir", str(run), "--resume", "--max-steps", "6", *flags])
        assert str(e.value).startswith(f"--resume: {shown}"), str(e.value)
        assert str(e.value).endswith(f"changes what the run's model checkpoints hold; keep the run's value "
                                     f"({run / 'config.json'}) or train into a new --run-dir"), str(e.value)
    assert _snapshot(run) == before

    # a config.json written before it held the JSON as written: the JSON is read again from the path the run used
    del saved["deepspeed_as_written"]
    (run / "config.json").write_text(json.dumps(saved))
    old = parse_args(["--run-dir", str(run), "--resume"])
    assert old.ds_config == json.loads(ds_file.read_text()) and old.recipe.train.max_steps == 4


def test_a_run_directory_in_use_by_another_run_is_refused(finished, tmp_path):
    """A run trains in the directory; a second launch on it (--overwrite, --resume, or none) is one line naming the
    holder, before anything is moved or written; once the first run ends, the directory is free again. The first run
    is paused (SIGSTOP) once it has logged a step, so its steps take no CPU from the checks: it still holds the
    directory."""
    run = _copy(finished, tmp_path)
    launch = Launch(launch_cmd(TRAIN, ["--run-dir", str(run), "--resume", "--max-steps", "100000",
                                       "--set", "train.save_interval=0"], nproc=0))
    first = launch.proc
    try:
        deadline = time.time() + 300
        while not ((run / ".lock").is_file() and "pid" in (run / ".lock").read_text()
                   and len(list((run / "tb").glob("events.out.tfevents.*"))) == 2):  # its own: it has trained
            assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.1)
        first.send_signal(signal.SIGSTOP)
        holder = (run / ".lock").read_text()
        assert holder.startswith(f"pid {first.pid} on ")
        with pytest.raises(UserError, match="another run is using it"):  # the preflight: before any worker starts
            resolve_run(parse_args([*RUN_ARGS, "--run-dir", str(run), "--overwrite"]), 1)
        argvs = [[*RUN_ARGS, "--run-dir", str(run), *flag] for flag in (["--overwrite"], ["--resume"], [])]
        proc = subprocess.run([sys.executable, "-c", MISTAKES, json.dumps(argvs)], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=600)
        assert_ok(proc)
        line = (f"memtrain: error: --run-dir {run}: another run is using it ({holder}); wait for it to end (or stop "
                f"it), or pass another --run-dir (no run left? a node lost while holding it: remove {run / '.lock'})")
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[2, [line]]] * 3
        assert not (run / ".overwritten").exists() and len(list((run / "tb").glob("events.out.tfevents.*"))) == 2
    finally:
        first.send_signal(signal.SIGCONT)
        first.send_signal(signal.SIGTERM)
        out, err = launch.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert json.loads((run / "summary.json").read_text())["status"] == "preempted"
    assert not (run / ".lock").exists()  # removed as the run ended: free for the next
    resolve_run(parse_args([*RUN_ARGS, "--run-dir", str(run), "--resume", "--max-steps", "100000"]), 1)


def test_rank_0_decides_the_resume_point_and_what_follows_from_it(finished, tmp_path, monkeypatch):
    """The newest checkpoint (step 4, the last) has a truncated shard: rank 0 reads the files and resumes from step 2;
    another rank checks names only, so its own pick would be step 4, "finished": it leaves that verdict to rank 0
    (whose choice every rank loads) instead of exiting alone and leaving rank 0 waiting at the rendezvous."""
    from memtrain.train.resume_check import check_resume

    run = _copy(finished, tmp_path)
    shard = run / "checkpoints" / tag_for(4) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:5000])
    monkeypatch.setenv("RANK", "0")
    assert check_resume(run, 1, 4).tag == tag_for(2)
    monkeypatch.setenv("RANK", "1")
    assert check_resume(run, 1, 4).tag == tag_for(4)  # by names; no verdict of its own
