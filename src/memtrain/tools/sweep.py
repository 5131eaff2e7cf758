"""`make sweep`: run every point of a grid of recipe overrides and DeepSpeed configs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, Optional


from memtrain.errors import ArgumentParser, UserError, cli_entry
from memtrain.tools.sweep_points import (DEFAULT_SWEEP, SET_ASIDE, TRAIN_PY, Point, SweepBar, Sweep, add_shrink_flags,
                                         finish_point, finished_differently, is_finished, last_step,
                                         load_sweep, prepare_point, read_summary, tail)
from memtrain.tools.slurm import run_array
from memtrain.train.ports import free_port

def run_deepspeed(sweep: Sweep, points: list[Point], progress: SweepBar) -> None:
    """One launcher process per point on this machine, one point after another: make train's launcher
    (memtrain.train.launch), which starts CPU ranks itself and GPU ranks through DeepSpeed's runner."""
    for point in points:
        args = prepare_point(sweep, point)
        cmd = [sys.executable, "-m", "memtrain.train.launch", "--num_gpus", str(sweep.spec.launcher.gpus_per_run),
               "--master_port", str(free_port()), str(TRAIN_PY), *args]
        stderr_log = point.run_dir / "stderr.log"
        with open(point.run_dir / "stdout.log", "ab") as out, open(stderr_log, "ab") as err:
            # Its own process group, so that stopping the sweep can stop the point's ranks too.
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
            try:
                while proc.poll() is None:
                    step = last_step(tail(stderr_log))
                    progress.step(point, "starting" if step is None else f"step {step}")
                    time.sleep(0.5)
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (see main)
                _stop_group(proc)
                raise
        finish_point(sweep, point, proc.returncode, progress)


def run_slurm(sweep: Sweep, points: list[Point], progress: SweepBar) -> None:
    """One Slurm job array, one point per array task (slurm/train.sbatch); see memtrain.slurm."""
    run_array(sweep, points, progress)


def _stop_group(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
    """SIGTERM a point's process group and wait for all of it: the ranks save at their next step
    boundary and write a `preempted` summary, so the next invocation resumes the point. (Signalling the group
    reaches the ranks whichever way they were started.)"""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the runner
            os.killpg(proc.pid, 0)  # ProcessLookupError once the whole group has exited
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


Launcher = Callable[[Sweep, list[Point], SweepBar], None]
LAUNCHERS: dict[str, Launcher] = {"deepspeed": run_deepspeed, "slurm": run_slurm}


# --------------------------------------------------------------------------- command line

def points_to_run(sweep: Sweep, force: bool) -> tuple[list[Point], list[Point]]:
    """(points to run, finished points kept although the sweep file changed). Without `force` a finished
    point is never run again; with it every point runs, and finished runs are moved aside first
    (`prepare_point`), never deleted."""
    if force:
        return list(sweep.points), []
    kept = [p for p in sweep.points if finished_differently(sweep, p)]
    return [p for p in sweep.points if not is_finished(sweep, p) and p not in kept], kept


def run_sweep(sweep: Sweep, force: bool = False, launcher: Optional[str] = None) -> list[Point]:
    """Run the points not yet finished (all with `force`); return the points that were run."""
    name = launcher or sweep.spec.launcher.name
    if name not in LAUNCHERS:
        raise UserError(f"launcher '{name}' (from {'LAUNCHER=' if launcher else f'{sweep.path}: launcher.name'}) "
                        f"is unknown; available: {', '.join(LAUNCHERS)}")
    todo, kept = points_to_run(sweep, force)
    n, done = len(sweep.points), len(sweep.points) - len(todo)
    print(f"sweep {sweep.name}: {n} point{'s' if n != 1 else ''}, {done} already finished, {len(todo)} to run "
          f"with the {name} launcher; run directories under {sweep.runs_dir}/", flush=True)
    if kept:
        print(f"sweep {sweep.name}: {len(kept)} point{'s' if len(kept) != 1 else ''} finished under a different "
              f"command (the sweep file changed) and kept as they are: {', '.join(p.id for p in kept)}; FORCE=1 "
              f"runs them again, moving the finished runs to {sweep.runs_dir / SET_ASIDE}/", flush=True)
    if todo:
        progress = SweepBar(sweep, done)
        try:
            LAUNCHERS[name](sweep, todo, progress)
        finally:
            progress.close()
    counts: dict[str, int] = {}
    for p in sweep.points:
        status = (read_summary(p.run_dir) or {}).get("status", "not run")
        counts[status] = counts.get(status, 0) + 1
    print(f"sweep {sweep.name}: " + ", ".join(f"{n} {s}" for s, n in counts.items())
          + f"; next: make report SWEEP={sweep.path}", flush=True)
    return todo


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m memtrain sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", nargs="?", default=DEFAULT_SWEEP, help=f"sweep file (default: {DEFAULT_SWEEP})")
    p.add_argument("--force", action="store_true",
                   help=f"rerun points that already finished (their runs are moved to <runs>/{SET_ASIDE}/, not deleted)")
    p.add_argument("--launcher", help=f"override the sweep file's launcher.name ({', '.join(LAUNCHERS)})")
    add_shrink_flags(p)
    return p


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: the point in flight stops cleanly
    try:
        sweep = load_sweep(args.sweep, args.set, args.grid)
        if args.set or args.grid:
            print(f"sweep {sweep.name}: {sweep.path} with {' '.join(args.set + args.grid)}, {len(sweep.points)} "
                  f"point(s) in {sweep.runs_dir}/ (make report takes the same SWEEP_ARGS)", flush=True)
        run_sweep(sweep, args.force, args.launcher)
    except KeyboardInterrupt:
        print("sweep interrupted; run it again to continue", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
