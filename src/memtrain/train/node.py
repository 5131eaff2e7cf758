"""This rank's node, as its launcher describes it: how many ranks its agent started here, and whether the node
holds global rank 0. torchrun sets LOCAL_WORLD_SIZE; DeepSpeed's launch.py sets LOCAL_SIZE only."""
from __future__ import annotations

import os


def agent_ranks(world: int, env=os.environ) -> int:
    """The ranks this process's launcher agent started on this node; `world` where no launcher says (make train's
    preflight: every rank on this machine)."""
    return int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world)


def holds_rank0(env=os.environ) -> bool:
    """This agent started global rank 0 (its first rank is rank 0)."""
    return int(env.get("RANK", 0)) - int(env.get("LOCAL_RANK", 0)) == 0
