"""make train's launcher starting CPU ranks itself (memtrain.train.local_launch): which lines and machines it takes,
the environment each rank gets (against what DeepSpeed's launch.py gives), and launch.py's rule on a failing rank."""
import json
import subprocess
import sys
import time


from memtrain.train import local_launch
from memtrain.train.local_launch import Local


ECHO = ("import json, os, sys\nfrom pathlib import Path\n"
        "out = Path(sys.argv[0]).parent / (os.environ['ECHO_TAG'] + '-' + os.environ['RANK'] + '.json')\n"
        "out.write_text(json.dumps([sys.argv[1:], {k: os.environ.get(k) for k in KEYS}]))\n")
KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE",
        "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR")


def test_ranks_get_what_deepspeeds_launch_gives_them(tmp_path, monkeypatch):
    """Each rank's argv and environment equal those DeepSpeed's own launch.py gives the same script (run here)."""
    import base64
    import os

    script = tmp_path / "echo.py"
    script.write_text(f"KEYS = {KEYS!r}\n{ECHO}")
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "ECHO_TAG": "theirs"}
    subprocess.run([sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
                    "--master_addr=127.0.0.1", "--master_port=29611", str(script), "--a", "1"],
                   capture_output=True, env=env, timeout=300, check=True)
    monkeypatch.setenv("ECHO_TAG", "mine")
    assert local_launch.wait(local_launch.start(Local(2, 29611, str(script), ("--a", "1")))) == 0
    for rank in (0, 1):
        want = json.loads((tmp_path / f"theirs-{rank}.json").read_text())
        assert json.loads((tmp_path / f"mine-{rank}.json").read_text()) == want
        assert want[0][0] == f"--local_rank={rank}" and want[1]["RANK"] == str(rank)


def test_a_failing_rank_ends_the_others_with_its_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(120)\n")
    started = time.monotonic()
    ranks = local_launch.start(Local(2, 29612, str(script), ()))
    assert local_launch.wait(ranks) == 3
    assert time.monotonic() - started < 30 and [r.poll() for r in ranks][1] == 3 and ranks[0].poll() is not None
