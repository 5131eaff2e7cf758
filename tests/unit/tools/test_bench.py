"""`make bench` and `make gpu-check` on CPU: set-up names, the gpu-check report written after each set-up, `--resume`,
the version line and the flags' one-line errors. The set-ups themselves run on a GPU only."""
import json

import pytest
import torch
from conftest import ROOT

from memtrain.errors import UserError


def test_bench_setup_names_with_zero3_flags():
    from memtrain.tools.bench.__main__ import GPU_CHECK_SETUPS
    from memtrain.tools.bench.setups import parse_setup

    s = parse_setup("memtrain:full+offload-leaf-resident")
    assert (s.ac, s.cpu_checkpointing, s.leaf, s.resident) == ("full", True, False, False)
    assert s.label == "trainer, policy 'full', memtrain offload, no leaf layers, not resident"
    s = parse_setup("memtrain:op@torch-leaf")
    assert (s.ac, s.backend, s.leaf, s.resident) == ("op", "torch", False, True)
    for name in GPU_CHECK_SETUPS:
        parse_setup(name)  # every gpu-check set-up parses


def test_bench_setups_search_and_table():
    from memtrain.tools.bench.__main__ import double_until_oom
    from memtrain.tools.bench.setups import parse_setup
    from memtrain.tools.bench.table import markdown, targets

    s = parse_setup("memtrain:op+first:4+offload@torch")
    assert (s.trainer, s.ac, s.backend, s.cpu_checkpointing, s.impl) == (True, "op+first:4", "torch", True, "memtrain")
    assert parse_setup("deepspeed:cpu-ckpt").impl == "deepspeed" and not parse_setup("torch:sac").trainer
    assert parse_setup("memtrain:full").backend == "auto"
    with pytest.raises(UserError, match="--setups"):
        parse_setup("memtrain:full@jax")

    probes = []
    assert double_until_oom(lambda mb: probes.append(mb) or mb <= 40, 8) == {"fits": 32, "oom_at": 64}
    assert probes == [16, 32, 64]
    assert double_until_oom(lambda mb: True, 8, limit=16) == {"fits": 16, "oom_at": None}

    def row(name, tok, peak, mb=8):
        return {"setup": name, "label": parse_setup(name).label, "micro_batch": mb, "tokens_per_s": tok,
                "peak_gib": peak, "activation_gib": 1.0, "offloaded_gib": 0.0, "predicted_peak_gib": peak * 1.02}

    results = [row("torch:noac", 100.0, 50.0), row("torch:hf-ac", 80.0, 20.0), row("memtrain:full", 90.0, 25.0),
               row("memtrain:full+offload", 81.0, 19.0),
               {"setup": "deepspeed:cpu-ckpt", "label": "x", "micro_batch": 8, "oom": True}]
    table = markdown(results, {"memtrain:full": {"fits": 32, "oom_at": 64}})
    assert "| memtrain:full+offload |" in table and "| 0.81 |" in table and "32 (OOM at 64)" in table
    assert "| deepspeed:cpu-ckpt | x | 8 | OOM |" in table
    goals = "\n".join(targets(results))
    assert "memtrain:full+offload / memtrain:full: 0.90 (target >= 0.95) - NOT met" in goals
    assert "memtrain:full+offload / torch:noac: 0.81 (target >= 0.8) - met" in goals
    assert "19.0 vs torch:hf-ac 20.0 (target <=) - met" in goals
    assert "deepspeed:cpu-ckpt / memtrain:full (DeepSpeed's own offload, for reference): not measured" in goals


def test_gpu_check_writes_after_each_set_up_and_stops_when_the_trainer_is_broken(tmp_path):
    """What an H100 run of 2026-11-25 returned (torch 2.11 image, before memtrain ran there): the peers measured,
    every trainer set-up failing alike. The report and JSON exist after any set-up; two trainer set-ups that fail
    the same way stop the run; an OOM or a different failure does not."""
    from memtrain.tools.bench.__main__ import same_failure_twice, write_gpu_check

    broken = "AttributeError: module 'torch.nn.functional' has no attribute 'linear_cross_entropy'"
    noac = {"setup": "torch:noac", "label": "plain", "micro_batch": 8, "wall_s": 48.0, "tokens_per_s": 43996.0,
            "peak_gib": 56.6}
    fail = lambda name, error=broken, **kw: {"setup": name, "label": name, "micro_batch": 8, "wall_s": 18.0,  # noqa: E731
                                             "oom": False, "error": error, **kw}
    results = [noac, fail("memtrain:full+offload")]
    assert not same_failure_twice(results)
    write_gpu_check(tmp_path, "NVIDIA H100 80GB HBM3", "t", results, {"memtrain:full+offload": "the log"})
    written = json.loads((tmp_path / "NVIDIA-H100-80GB-HBM3.json").read_text())["results"]
    assert [r["setup"] for r in written] == ["torch:noac", "memtrain:full+offload"]
    assert (tmp_path / "failed.log").read_text() == "the log"
    assert "| torch:noac | plain |  | 8 | 43,996 | 1.00 | 56.60 |" in (tmp_path / "NVIDIA-H100-80GB-HBM3.md").read_text()
    assert same_failure_twice([*results, {"setup": "torch:hf-ac", "label": "", "micro_batch": 8, "wall_s": 46.0,
                                          "tokens_per_s": 35067.0}, fail("memtrain:op")])
    assert not same_failure_twice([*results, fail("memtrain:op", "another error")])
    assert not same_failure_twice([*results, fail("memtrain:op", oom=True)])
    no_budget = {"setup": "memtrain:auto", "label": "", "micro_batch": 8, "error": broken}  # never started
    assert not same_failure_twice([fail("memtrain:full"), no_budget])
    slow = "timed out after 300 s (killed)"  # a cold compile cache, not a broken trainer: the run goes on
    assert not same_failure_twice([fail("memtrain:op+compile", slow), fail("memtrain:auto+compile", slow)])


def test_gpu_check_resume_keeps_what_measured_and_runs_failures_again(tmp_path, capsys):
    """A gpu-check split across calls (the device lease's 10-minute limit): --resume keeps what the device's
    report measured (an OOM is a measurement), in the order asked, and runs failed set-ups again."""
    from memtrain.tools.bench.__main__ import measured_before, write_gpu_check

    ok = lambda name, **kw: {"setup": name, "label": name, "micro_batch": 8, "tokens_per_s": 1.0, **kw}  # noqa: E731
    results = [ok("torch:noac", peak_gib=50.0, measured_at="2026-11-26 10:00:00 UTC", software="torch 2.11.0"),
               ok("memtrain:op", software="torch 2.11.0"),
               {"setup": "memtrain:full", "label": "", "micro_batch": 8, "oom": False, "error": "boom"},
               {"setup": "memtrain:none", "label": "", "micro_batch": 8, "oom": True}]
    write_gpu_check(tmp_path, "NVIDIA H200", "t", results, {})
    assert measured_before(tmp_path, "NVIDIA H100", "t", ["torch:noac"]) == []  # another device's report is not this one's
    assert measured_before(tmp_path, "NVIDIA H200", "on 8 x NVIDIA H200", ["torch:noac"]) == []  # nor another check's
    assert "is the report of another check ('t', not 'on 8 x NVIDIA H200')" in capsys.readouterr().out
    kept = measured_before(tmp_path, "NVIDIA H200", "t", ["memtrain:op", "memtrain:full", "torch:noac"])
    assert [r["setup"] for r in kept] == ["memtrain:op", "torch:noac", "memtrain:none"]
    later = ok("memtrain:full", measured_at="2026-11-26 10:09:00 UTC", software="torch 2.13.0")
    report = write_gpu_check(tmp_path, "NVIDIA H200", "t", [*kept, later], {})
    assert "Measured 2026-11-26 10:00:00 UTC to 2026-11-26 10:09:00 UTC." in report
    assert "Software: torch 2.11.0; torch 2.13.0." in report  # a resumed check says when its calls' versions differ
    (tmp_path / "NVIDIA-H200.json").write_text('{"title": "t", "res')  # cut short by hand: measured again, one line
    assert measured_before(tmp_path, "NVIDIA H200", "t", ["torch:noac"]) == []
    assert "cannot be read" in capsys.readouterr().out


def test_gpu_check_names_the_versions_it_runs():
    """The report's software line: torch's own version and the installed transformers and DeepSpeed, read from
    their metadata (here: requirements.lock's pins)."""
    from memtrain.tools.bench.__main__ import software_versions

    pins = dict(line.strip().split("==") for line in (ROOT / "requirements.lock").read_text().splitlines()
                if line.startswith(("transformers==", "deepspeed==")))
    assert software_versions() == (f"torch {torch.__version__}, transformers {pins['transformers']}, "
                                   f"DeepSpeed {pins['deepspeed']}")


@pytest.mark.parametrize("argv, line", [
    (["--setup-timeout", "0"], "--setup-timeout: must be positive seconds (got 0)"),
    (["--resume"], "--resume: continues a --gpu-check run; make bench has nothing to resume"),
])
def test_bench_flag_mistakes_are_one_line(argv, line, capsys):
    from memtrain.tools.bench.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(line), err


def test_bench_host_shows_the_median_round_and_the_range():
    """Interleaved rounds: each set-up shows its median run (with that run's counters) and every round's tokens/s;
    a failure in any round is shown, never hidden behind the other rounds."""
    from memtrain.tools.bench.host import markdown, median_runs

    rounds = [{"setup": "torch:noac", "label": "plain", "tokens_per_s": t, "probe": {"cpu_s": t / 1e6}}
              for t in (9000.0, 12000.0, 10000.0)]
    best = median_runs(rounds)
    assert best["tokens_per_s"] == 10000.0 and best["probe"]["cpu_s"] == 0.01
    assert best["tokens_per_s_runs"] == [9000.0, 12000.0, 10000.0]
    assert "| torch:noac | plain | 10,000 | 9,000-12,000 | 1.00 |" in markdown([best])
    assert median_runs([*rounds[:2], {"setup": "torch:noac", "error": "boom"}]) == {"setup": "torch:noac",
                                                                                      "error": "boom"}


def test_bench_host_legend_clears_the_axis_label(tmp_path, monkeypatch):
    """make bench-host's plot: the legend sits below the x-axis label, not over it (their boxes as drawn)."""
    from matplotlib.figure import Figure

    from memtrain.tools.bench.host import plot

    boxes = {}
    real_savefig = Figure.savefig

    def keep(fig, path, *a, **k):
        def drawn(event):  # the boxes as the file has them (saved at its own dpi)
            legend = fig.legends[0] if fig.legends else fig.axes[0].get_legend()  # the figure's or the axes'
            boxes.update(label=fig.axes[0].xaxis.label.get_window_extent(event.renderer),
                         legend=legend.get_window_extent(event.renderer), figure=fig.bbox)

        fig.canvas.mpl_connect("draw_event", drawn)
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    rows = [{"setup": s, "tokens_per_s": t} for s, t in (("torch:noac", 1000.0), ("torch:hf-ac", 800.0),
                                                         ("memtrain:full", 700.0), ("memtrain:full-leaf-resident", 500.0))]
    plot(rows, tmp_path / "host.png", "a title")
    assert not boxes["legend"].overlaps(boxes["label"]) and boxes["legend"].y1 < boxes["label"].y0, boxes
    assert boxes["legend"].y0 >= boxes["figure"].y0  # and inside the figure
