"""memtrain: DeepSpeed ZeRO-3 training recipes with measured activation recompute (AC) policies."""

__version__ = "0.1.0"
