"""Nothing of an earlier run is lost: `--overwrite` with a mistake, a failure or a kill, and `--resume` of a
damaged or finished run directory. Single-process `python src/train.py` runs: the launcher adds nothing here.

Every comparison is against a snapshot (sha256 of every file) taken before the mistake, and resumed
losses are compared with the losses the uninterrupted run logged, read back from TensorBoard.
"""
import os

import pytest

from memtrain.errors import UserError


def test_a_requeued_slurm_job_goes_on_past_its_own_stale_lock(tmp_path, monkeypatch):
    """A lock that this Slurm job's earlier attempt left held (a lost node's NFS lock outlives it) does not refuse the
    requeue (same job id): a warning; another job's lock still refuses."""
    import fcntl

    from memtrain.train import run_dir as run_dirs

    run = tmp_path / "run"
    run.mkdir()
    fd = os.open(run / ".lock", os.O_RDWR | os.O_CREAT)  # the earlier attempt's lock, still held
    os.write(fd, b"pid 77 on node3 since 2026-11-26 01:00:00 (slurm job 4242)")
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        run_dirs.check_not_in_use(run)
        refusal, warning = run_dirs.lock(run)
        assert refusal is None and "held by this Slurm job's earlier attempt" in warning
        monkeypatch.setenv("SLURM_JOB_ID", "5555")
        with pytest.raises(UserError, match="another run is using it"):
            run_dirs.check_not_in_use(run)
    finally:
        os.close(fd)
