"""The ingest stage's family: every URL of the source downloaded once, politely, into WebDataset tars.

- `stage.py`: the stage top to bottom: shards cut from each source partition (identity from the data),
  a Ray task per shard, the shards of a source partition joined into the later stages' partitions,
  the report of failures by host and reason.
- `fetch.py`: the safe fetcher img2dataset's downloader calls for each URL: the address checked and
  pinned, the size, pixels and format bounded, the deadline kept, every failure a recorded reason.
- `polite.py`: per-host manners: robots.txt, a rate that adapts to each host, Retry-After, a circuit
  breaker, and a pacer that gives a waiting task's CPU back to Ray.
- `shared_urls.py`: URLs several shards name, downloaded once for the run.
- `img2dataset_parts.py`: img2dataset's downloader and resizer, imported without its command line.
"""
from .stage import IngestConfig, IngestStage

__all__ = ["IngestConfig", "IngestStage"]
