"""final/'s weights streamed to disk: gathered one module at a time (ZeRO-3 partitions, AutoTP shards) and written
by rank 0 as safetensors shards while they arrive.

Rank 0's host memory holds one shard, not the whole model (140 GB in bf16 for a 70B model). The other ranks wait
for rank 0 inside a collective, under train.collective_timeout_s, while it writes a shard: each shard is sized so
its write takes at most a quarter of that timeout at the disk rate measured on the shards before it (the first at
an assumed 10 MB/s), and every rank learns the next size from rank 0 in one broadcast after each shard. So a slow
disk makes more, smaller shards instead of a timeout that kills the job at its very end. A single tensor larger
than a shard is written alone. The shards are transformers' sharded layout (`model-00001-of-0000N.safetensors` and
`model.safetensors.index.json`; one shard: `model.safetensors`), each fsync'ed before the next is gathered.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch
from deepspeed.module_inject.layers import GatherReplacedLayerParams
from safetensors.torch import save_file
import deepspeed
import torch.distributed as dist

SHARE = 0.25  # of the collective timeout that one shard's write may take
FIRST_RATE = 10e6  # bytes/s assumed for the first shard, before any write was measured
MAX_SHARD = 2 * 2**30  # bytes: bounds rank 0's host memory; transformers loads shards of any size
MIN_SHARD = 2**20
INDEX = "model.safetensors.index.json"
TMP = ".shard-"


def shard_bytes(rate: float, timeout_s: float) -> int:
    """The shard size whose write takes SHARE of `timeout_s` at `rate` bytes/s, within [MIN_SHARD, MAX_SHARD]."""
    return int(min(MAX_SHARD, max(MIN_SHARD, rate * timeout_s * SHARE)))


class ShardWriter:
    """Rank 0's side: tensors kept on the host until `flush` writes them as one shard."""

    def __init__(self, out: Path, timeout_s: float) -> None:
        self.out, self.timeout_s = out, timeout_s
        self.pending: dict[str, torch.Tensor] = {}
        self.shards: list[list[str]] = []
        self.written, self.seconds = 0, 0.0
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("model*.safetensors"), *out.glob(f"{TMP}*"), *out.glob("pytorch_model*.bin"),
                      out / INDEX]:  # an earlier final/: a stale file beside the new ones would be loaded
            stale.unlink(missing_ok=True)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        self.pending[key] = tensor.detach().to("cpu", copy=True).contiguous()  # never a view of a flat buffer

    def flush(self) -> int:
        """Write the pending tensors as the next shard (fsync'ed); the next shard's size from the rate so far."""
        path = self.out / f"{TMP}{len(self.shards)}"
        started = time.perf_counter()
        save_file(self.pending, str(path), metadata={"format": "pt"})
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.seconds += time.perf_counter() - started
        self.written += sum(t.numel() * t.element_size() for t in self.pending.values())
        self.shards.append(list(self.pending))
        self.pending = {}
        return shard_bytes(self.written / max(self.seconds, 1e-6), self.timeout_s)

    def close(self) -> None:
        """The shards renamed to transformers' names, with the index where there are several."""
        if self.pending or not self.shards:
            self.flush()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            os.replace(self.out / f"{TMP}{i}", self.out / name)
        if n > 1:
            weight_map = {key: name for name, keys in zip(names, self.shards) for key in keys}
            index = {"metadata": {"total_size": self.written}, "weight_map": weight_map}
            (self.out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def stream_weights(module: torch.nn.Module, out: Path, timeout_s: float, device: torch.device) -> None:
    """On every rank (each gather is a collective): `module`'s parameters and persistent buffers, once each (a tied
    weight under its first name), written by rank 0 into `out` shard by shard."""
    writer = ShardWriter(out, timeout_s) if dist.get_rank() == 0 else None
    budget, pending, seen = shard_bytes(FIRST_RATE, timeout_s), 0, set()
    kept = set(module.state_dict(keep_vars=True))  # parameters and the buffers that are not marked non-persistent
    for prefix, mod in module.named_modules():
        params = list(mod.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0), GatherReplacedLayerParams(params, mod):
            for name, tensor in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
                key = f"{prefix}.{name}" if prefix else name
                ident = ("zero", tensor.ds_id) if hasattr(tensor, "ds_id") else id(tensor)  # ds_id: one per weight
                if key not in kept or ident in seen:
                    continue
                seen.add(ident)
                pending += tensor.numel() * tensor.element_size()  # the gathered size, alike on every rank
                if writer is not None:
                    writer.add(key, tensor)
        if pending >= budget:
            budget, pending = _next_budget(writer, device), 0
    if writer is not None:
        writer.close()


def _next_budget(writer: Optional[ShardWriter], device: torch.device) -> int:
    """Rank 0 writes its pending shard while the others wait here; then all take rank 0's next shard size."""
    size = torch.tensor([writer.flush() if writer is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    return int(size.item())  # once a shard, not a step: a host sync here costs nothing


def write_config(module, out: Path) -> None:
    """Rank 0: config.json (its dtype and architecture, as transformers' save_pretrained sets them) and, for a
    model that generates, generation_config.json."""
    module.config.dtype = str(module.dtype).split(".")[1]
    module.config.architectures = [type(module).__name__]
    module.config.save_pretrained(out)
    if module.can_generate():
        module.generation_config.save_pretrained(out)
