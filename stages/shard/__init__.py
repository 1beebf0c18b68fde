"""The shard stage's family: the kept samples written as WebDataset shards, and the dataset line.

- `stage.py`: the stage top to bottom: a plan per partition (what it places, read once), the
  shuffle to shards of a seeded order through Ray's object store, byte-identical tars, the line's
  publication per partition.
- `line.py`: a dataset line (`stages.shard.append`): its shards, which run added each, what each
  partition published; published shards never change.
- `line_lookup.py`: the line's index by key, URL and sha256 (what `capline remove` reads).
- `removals.py`: what removals name, as dedup and the shard stage apply them.
"""
from .stage import ShardConfig, ShardStage

__all__ = ["ShardConfig", "ShardStage"]
