"""One rank of test_final_weights: `python tests/final_weights_worker.py RANK PORT OUT TIMEOUT_S RATE`.

Both ranks build the same seeded Llama and stream it into OUT with memtrain.train.final_weights under a gloo group
whose collectives time out after TIMEOUT_S. Rank 0's disk is made slow here, in the test's own process: each fsync
sleeps its file's bytes / RATE first, so the whole model takes longer than the timeout to write."""
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=384, intermediate_size=1024,
                                        num_hidden_layers=4, num_attention_heads=6, tie_word_embeddings=True))


if __name__ == "__main__":
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    timeout_s, rate = float(sys.argv[4]), float(sys.argv[5])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=300))
    net = model()
    store.add("ready", 1)  # both built and imported: only then does the short timeout start to count
    while store.add("ready", 0) < 2:
        time.sleep(0.05)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=timeout_s))
    if rank == 0:
        real_fsync = os.fsync

        def slow_fsync(fd):
            time.sleep(os.fstat(fd).st_size / rate)
            real_fsync(fd)

        os.fsync = slow_fsync
    from memtrain.train.final_weights import stream_weights, write_config

    started = time.perf_counter()
    stream_weights(net, out, timeout_s, torch.device("cpu"))
    if rank == 0:
        write_config(net, out)
    dist.barrier()
    print(f"rank {rank} streamed in {time.perf_counter() - started:.1f} s", flush=True)
    dist.destroy_process_group()
    # as src/train.py ends: the interpreter's teardown of torch's C++ objects once aborted rank 1 here
    # ("terminate called without an active exception", exit -6, CI 2026-11-27) after both ranks had streamed
    from memtrain.quick_exit import quick_exit

    quick_exit()
