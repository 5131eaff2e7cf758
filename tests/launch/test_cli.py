"""`python -m memtrain <command>`: one front door lists and dispatches every tool; each command's --help works."""
import subprocess
import sys


from conftest import ROOT, _env
from memtrain.__main__ import COMMANDS


def test_front_door_lists_every_command():
    listed = subprocess.run([sys.executable, "-m", "memtrain", "--help"], cwd=ROOT, env=_env(), capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0
    for name in ("train", "preflight", "plan", "explain-config", "ac-profile", "sweep", "report", "bench",
                 "gpu-check", "bench-host", "bench-plan", "export", "prepare-data", "bench-data"):
        assert f"\n  {name} " in listed.stdout, listed.stdout
    unknown = subprocess.run([sys.executable, "-m", "memtrain", "trian"], cwd=ROOT, env=_env(), capture_output=True,
                             text=True, timeout=120)
    assert unknown.returncode == 2 and unknown.stderr.startswith("memtrain: error: unknown command 'trian'")


HEAVY = ("torch", "deepspeed", "transformers")


def test_help_imports_no_torch():
    """Every command's --help, and src/train.py's, in a fresh interpreter: it imports none of torch, DeepSpeed or
    transformers (their imports are the seconds a --help waited for), and its usage line names the command."""
    probe = (f"import sys, contextlib, io\nfrom memtrain.__main__ import main\nHEAVY = {HEAVY!r}\n"
             "for command in sys.argv[1:]:\n"
             "    out = io.StringIO()\n"
             "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
             "        main([command, '--help'])\n"
             "    print(command, '|', out.getvalue().splitlines()[0], '|', sorted(set(HEAVY) & set(sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", probe, *COMMANDS], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [line.split(" | ") for line in done.stdout.splitlines()]
    assert [r[0] for r in rows] == list(COMMANDS), done.stdout
    for command, usage, heavy in rows:
        assert usage.startswith(f"usage: python -m memtrain {command} [-h]") and heavy == "[]", (command, usage, heavy)
    direct = subprocess.run([sys.executable, "-X", "importtime", "src/train.py", "--help"], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert direct.returncode == 0 and direct.stdout.startswith("usage: src/train.py [-h]"), direct.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in direct.stderr.splitlines() if line.count("|") == 2}
    assert "memtrain.config.args" in imported and not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_make_variables_with_spaces_stay_one_argument():
    """`make report BUDGET="40 GB"` (and paths with spaces): each variable reaches the command as one argument."""
    import shlex

    dry = subprocess.run(["make", "-n", "report", "plan", "BUDGET=40 GB", "SWEEP=my sweeps/s.yaml", "DS=my ds.json",
                          "RECIPE=my recipe.yaml"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.replace("\\\n", " ").splitlines()  # make -n prints a recipe's continued lines as written
    report, plan = [shlex.split(line) for line in lines if " -m memtrain " in line]
    assert report[report.index("report") + 1] == "my sweeps/s.yaml" and "--budget=40 GB" in report
    assert "--budget=40 GB" in plan and plan[plan.index("--deepspeed") + 1] == "my ds.json"
    assert plan[plan.index("--recipe") + 1] == "my recipe.yaml"


def test_quick_exit_does_what_an_exit_does_but_the_teardown(tmp_path):
    """memtrain.quick_exit, as the end of a finished command: a thread that is not a daemon finishes its work, atexit
    handlers run, buffered stdout arrives, and the exit code is the one given. An idle thread pool's workers (as
    torch.compile's first, cold-cache compile leaves them in a rank) are ended as at a normal exit, not waited on
    forever: make train's compiled runs hung there after writing their summary."""
    script = ("import atexit, concurrent.futures, sys, threading, time\n"
              "from pathlib import Path\n"
              "from memtrain.quick_exit import quick_exit\n"
              f"out = Path({str(tmp_path)!r})\n"
              "atexit.register(lambda: (out / 'atexit').write_text('ran'))\n"
              "threading.Thread(target=lambda: (time.sleep(0.3), (out / 'thread').write_text('done'))).start()\n"
              "pool = concurrent.futures.ThreadPoolExecutor(2)\n"
              "pool.submit(time.sleep, 0.1).result()\n"
              "sys.stdout.write('buffered, no newline')\n"
              "quick_exit(3)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "buffered, no newline", "")
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "done"
