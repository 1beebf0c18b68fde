"""The source stage's family: the URL list (or a built-in source) read into keyed partitions.

- `stage.py`: the stage top to bottom: each list file pinned and keyed by its content (unchanged
  files are neither uploaded nor keyed again), rows checked and bounded, a partition per file and
  block of rows (identity from the data, never from the cluster), what a row carries to the end.
- `keys.py`: keys unique across every list file, checked by a shuffle that reads each key once.
- `synthetic.py`, `openclipart.py`, `web_shapes.py`: the built-in sources (the demo's scenes with
  planted defects, Debian's openclipart SVGs, real photos of mixed shapes), served over loopback by
  `demo_server.py` so ingest downloads them as it downloads the web.
"""
from .stage import SourceConfig, SourceStage

__all__ = ["SourceConfig", "SourceStage"]
