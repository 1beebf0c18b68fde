"""img2dataset's downloader and resizer for an ingest worker, without the package's start-up cost.

`import img2dataset.downloader` first runs img2dataset/__init__.py, which imports its command
(`main`: pandas, the distributor, the reader) and, through its WebDataset writer, webdataset and
with it torch: 5.4 s of imports in every ingest worker process, of which the download uses ~1.4 s.
An append's cold workers, 16 on two cores in `benchmarks/partitions.py`, spent 37 s importing
before the first URL. Here:

- the package (and wandb, which its logger imports) is registered without running its __init__;
  the first time anything asks the package for a name it does not hold yet (`img2dataset.download`,
  `.main`), the __init__ runs then, so every other caller in the process sees it as usual;
- the shard's tar and parquet are written by `TarSampleWriter`, img2dataset's sample-writer
  interface and layout (`<key>.jpg`, `.json`, `.txt`; a parquet row per URL, failures included)
  with capline's one tar writer (infra/tars.py) instead of webdataset's TarWriter: fixed member
  headers (mtime 0), so a shard downloaded twice with the same bytes is the same tar.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import threading

from infra.tars import SampleTarWriter

_LOCK = threading.Lock()


def lazy_package(name: str):
    """Register package `name` with its __init__ deferred to the first missing attribute."""
    with _LOCK:
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.find_spec(name)
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(f"{name} is not an installed package")
        module = importlib.util.module_from_spec(spec)

        def __getattr__(attr: str):
            # the real __init__, once, in this same module object: names already imported stay
            with _LOCK:
                if module.__dict__.pop("__getattr__", None) is not None:
                    spec.loader.exec_module(module)
            try:
                return module.__dict__[attr]
            except KeyError:
                raise AttributeError(f"module {name!r} has no attribute {attr!r}") from None

        module.__getattr__ = __getattr__
        sys.modules[name] = module
        return module


def prepare() -> None:
    """Register img2dataset, and wandb (which its logger imports at the top and the download never
    uses), as lazy packages. wandb, run, makes two temporary folders that a worker Ray kills never
    removes: 2,358 of them were left in /tmp here after a day of runs."""
    lazy_package("wandb")
    lazy_package("img2dataset")


def downloader_classes():
    """-> (img2dataset's Downloader, its Resizer), imported without img2dataset's command."""
    prepare()
    from img2dataset.downloader import Downloader
    from img2dataset.resizer import Resizer

    return Downloader, Resizer


class TarSampleWriter:
    """img2dataset's `sample_writer_class` interface, writing its WebDataset layout: per image
    `<key>.<format>`, `<key>.json` (the metadata, indented as img2dataset does) and `<key>.txt`, in
    webdataset's order (extensions sorted), USTAR headers; `<shard>.parquet` holds every URL's
    metadata row, failed ones included, in img2dataset's schema."""

    def __init__(self, shard_id, output_folder, save_caption, oom_shard_count, schema, encode_format):
        name = f"{shard_id:0{oom_shard_count}d}"
        self.save_caption, self.schema, self.encode_format = save_caption, schema, encode_format
        self.tar_path = f"{output_folder}/{name}.tar"
        self.parquet_path = f"{output_folder}/{name}.parquet"
        self._file = open(self.tar_path, "wb")
        self._tar = SampleTarWriter(self._file)
        self._rows: dict[str, list] = {k: [] for k in schema.names}

    def write(self, img_str, key, caption, meta):
        if img_str is not None:
            members = {self.encode_format: img_str, "json": json.dumps(_plain(meta), indent=4).encode()}
            if self.save_caption:
                members["txt"] = (str(caption) if caption is not None else "").encode()
            self._tar.add(key, [(ext, members[ext]) for ext in sorted(members)])
        for k in self.schema.names:
            self._rows[k].append(meta[k])

    def close(self):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pydict(self._rows, self.schema), self.parquet_path)
        self._tar.close()
        self._file.close()


def _plain(meta: dict) -> dict:
    """Metadata JSON can hold numpy arrays (img2dataset's own writer turns them into lists)."""
    return {k: (v.tolist() if hasattr(v, "tolist") and not isinstance(v, (int, float, str)) else v)
            for k, v in meta.items()}
