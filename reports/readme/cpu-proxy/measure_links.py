"""gloo's collectives between 2 CPU processes on this machine (the CPU proxy's "links"): seconds per call of
all_reduce, reduce_scatter and all_gather on fp32 tensors of a few sizes, median of repeats, printed with the
load average. The cpu-2.yaml sheet's link rate and --verify's per-call overhead come from these figures.

    PYTHONPATH=src python reports/readme/cpu-proxy/measure_links.py
"""
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (4_096, 262_144, 3_500_000, 14_000_000)  # bytes; 3.5 MB is the tiny recipe's fp32 gradients
REPEATS = 15


def timed(fn) -> float:
    samples = []
    for _ in range(REPEATS):
        dist.barrier()
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples[2:])


def worker(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = []
    for size in SIZES:
        n = size // 4
        x, half, whole = torch.ones(n), torch.empty(n // 2), torch.empty(n)
        rows.append((size, timed(lambda: dist.all_reduce(x)),
                     timed(lambda: dist.reduce_scatter_tensor(half, x)) if hasattr(dist, "reduce_scatter_tensor") else None,
                     timed(lambda: dist.all_gather_into_tensor(whole, x[: n // 2]))))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main() -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29_500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    rows = q.get()
    for p in procs:
        p.join()
    print(f"load average {os.getloadavg()}, torch {torch.__version__}")
    print(f"{'bytes':>12} {'all_reduce ms':>14} {'reduce_scatter ms':>18} {'all_gather ms':>14}  all_reduce GB/s of the tensor")
    for size, ar, rs, ag in rows:
        rs_ms = f"{rs * 1e3:18.3f}" if rs is not None else f"{'-':>18}"
        print(f"{size:>12,} {ar * 1e3:14.3f} {rs_ms} {ag * 1e3:14.3f}  {size / ar / 1e9:.2f}")


if __name__ == "__main__":
    main()
