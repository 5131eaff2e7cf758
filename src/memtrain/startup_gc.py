"""A process's start-up imports kept out of the garbage collector's sight: the collector held while torch,
transformers and DeepSpeed import, then everything they made frozen (`gc.freeze`) and the collector back on.

Their hundreds of thousands of long-lived objects made every full collection scan them again: on the shared 2-core
machine (2026-11-27) a rank of a 3-step `make train` spent 1.3 of its 6.4 CPU-s in the collector, 1.0 of them in
8 full collections: 6 during the imports and DeepSpeed's own `gc.collect()` calls in ZeRO-3's set-up (0.2 CPU-s
each). Module imports make little cyclic garbage; objects made after the freeze are collected as usual."""
from __future__ import annotations

import gc

_held = [False]


def hold() -> None:
    """The collector off for the imports that follow (until `imports_done`)."""
    if gc.isenabled():
        gc.disable()
        _held[0] = True


def imports_done() -> None:
    """What the imports made frozen and the collector back on; nothing unless `hold` turned it off (once a
    process: a later call, e.g. a second run in the same process, leaves that run's objects collectable)."""
    if _held[0]:
        gc.freeze()
        gc.enable()
        _held[0] = False
