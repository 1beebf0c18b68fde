"""A model a stage's partitions share: loaded once per actor of a pool, not once per worker process.

A stage whose per-partition function needs a model (fastText's lid.176, the CLIP scorer, dedup's
encoder) declares it as a SharedModel: how to load it and what one loaded copy holds. The executor
(pipeline/model_pool.py) then runs those partitions on a pool of Ray actors: each actor loads the
model once, in its constructor, and works through partitions one after another; the pool has at
most as many actors as the nodes have room for (CPUs, GPUs and the declared memory), so a node
holds that many copies, each known to Ray's scheduler. Run as plain tasks, every worker process a node starts (up to ~1.3 per CPU) loads
its own copy, which Ray does not know about: ~1.7 GB x 42 processes on a 32-core node for a
CLIP L/14 scorer.

`load(*args)` fills the worker process's own cache (the stage's `_backend`, `_scorer`), the same
cache the partition function reads, so the function finds the model loaded and never loads it
again in that actor. Nothing here imports Ray: the stage declares, the executor runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# What an actor holds besides its model's weights. Measured on this machine (an actor of the pool,
# psutil's RSS after judging): with fastText's lid.176 (23 MB of it) 185 MB, with langid.py 200 MB;
# with torch and a 1.2 MB bootstrap scorer, after scoring 64 pictures, 369 MB.
WORKER_MB = 200.0     # Python, pyarrow, numpy, capline's modules and a partition's rows
TORCH_MB = 300.0      # torch itself and a batch's activations at a small model's width


@dataclass(frozen=True)
class SharedModel:
    name: str                      # what is loaded, for messages ("fastText lid.176")
    # load(*args): warms the worker's cache; what it returns is not kept. None: the partition
    # function loads it on its first call (a model that arrives through Ray's object store as an
    # argument of each call: an actor's constructor holding a reference could not be restarted)
    load: Callable | None
    args: tuple = ()
    memory_mb: float = 0.0         # one actor's resident memory with the model loaded, declared to Ray
    setting: str | None = None     # the setting that changes the model's size or where it runs

    def __post_init__(self):
        if self.memory_mb < 0:
            raise ValueError(f"{self.name}: memory_mb must be >= 0, got {self.memory_mb}")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_mb * 2 ** 20)
