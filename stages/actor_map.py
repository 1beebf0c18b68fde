"""Run a per-batch model over a Ray Dataset with an actor pool: each actor loads its model once.

The one mechanism the dedup, language and CLIP-score stages share. `actor_cls(*args)` is constructed
once per actor; it is called with numpy batches and returns numpy batches (it may return fewer rows).
`collect` brings results to the driver as one dict of numpy arrays sorted by `key`, so the number of
actors and the batch boundaries cannot change what a stage decides.

Actors should ask for less than a whole CPU each (the defaults use 0.5-0.75): Ray Data's read tasks
need CPU too, and a pool that takes every CPU of a small cluster waits for them forever.
"""
from __future__ import annotations

import numpy as np


def bind(actor_cls, args: tuple):
    """A subclass that takes no constructor arguments: they travel inside the class, not the object
    store, so Ray does not warn that a restarted actor could lose them (ray-project/ray#53727)."""
    class Bound(actor_cls):
        def __init__(self):
            super().__init__(*args)

    Bound.__name__ = Bound.__qualname__ = actor_cls.__name__
    return Bound


def map_actors(ds, actor_cls, args: tuple, num_workers: int, batch_size: int, num_cpus: float,
               num_gpus: float = 0.0):
    import ray

    # up to num_workers actors: a small input with fewer blocks than that starts fewer
    pool = ray.data.ActorPoolStrategy(min_size=1, max_size=num_workers)
    return ds.map_batches(bind(actor_cls, args), compute=pool, num_cpus=num_cpus, num_gpus=num_gpus or None,
                          batch_size=batch_size, batch_format="numpy")


def collect(ds, columns: list[str], key: str = "key") -> dict[str, np.ndarray]:
    parts: dict[str, list] = {c: [] for c in columns}
    for batch in ds.iter_batches(batch_size=4096, batch_format="numpy"):
        for c in columns:
            parts[c].append(batch[c])
    out = {c: np.concatenate(v) if v else np.array([]) for c, v in parts.items()}
    order = np.argsort(out[key], kind="stable")
    return {c: v[order] for c, v in out.items()}


def table_dataset(table, batch_size: int, num_workers: int):
    """An in-memory Arrow table as a Ray Dataset, in enough blocks to keep every actor busy."""
    import ray

    blocks = max(1, min(num_workers * 4, table.num_rows // max(1, batch_size) + 1))
    return ray.data.from_arrow(table).repartition(blocks)


def ingest_dataset(ingest_dir, suffixes=("jpg", "json")):
    """The ingest shards as a Ray Dataset of raw bytes (one block per shard)."""
    import ray

    from .ingest import shard_paths

    shards = [str(p) for p in shard_paths(ingest_dir)]
    return ray.data.read_webdataset(shards, decoder=None, suffixes=list(suffixes), num_cpus=0.25,
                                    override_num_blocks=max(1, len(shards)))
