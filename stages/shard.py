"""The shard stage: the kept samples as final WebDataset shards, byte-reproducible.

Order: a global shuffle by sha256(seed:key), independent of arrival order and worker count: a
sample goes to output shard (that hash mod the number of shards), and each shard holds its samples
in hash order. A map task per input partition reads its images once through the sample index and
writes them to their shards' buckets; a reduce task per output shard writes the tar, its index and
its ledger partition, and records the tar's sha256. The driver only counts.
Each sample is `<key>.jpg` (the bytes ingest stored), `<key>.txt` (the caption) and `<key>.json`:
img2dataset's fields (key, url as fetched, caption, status, error_message, width and height as
stored, original_width/original_height, sha256 of the bytes downloaded) plus what every filter
recorded (`clip_score`, `language_score`, `language`, ...). Tar members have mtime 0, owner 0:0,
mode 0444 and USTAR headers, so equal content gives equal bytes. There are enough shards that each
holds about `samples_per_shard` samples and stays under `max_shard_bytes`, and, for small data, at
least `min_shards` (each training worker needs a shard of its own; a config value, not the train
section's worker count, so changing training never invalidates the shards); each is written whole
(temp file and rename, or one PUT).

Beside the tars, in `shards/`, what users' readers look for there: `sizes.json` (shard -> samples,
open_clip's `get_dataset_size`) and `shardindex.json` (the `wids` shard index: url, nsamples,
filesize, md5sum). In `shard/`: `shards.json` (name, samples, bytes, sha256 per shard),
`index/<shard>.parquet` (key -> shard, byte offset of the sample's first member) so a reader can
count and seek, and `README.md`, the dataset card.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import tarfile
from typing import ClassVar
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute

from infra.configtools import join, require

from .base import KEPT, Sink, StageContext, StageResult
from .dataplane import by_location, image_batches, read_kept, write_part
from infra.hashing import order_key
from infra.shuffle import BucketWriter, read_bucket


@dataclass
class ShardConfig:
    REMOVED: ClassVar[dict] = {"num_workers": "the executor sizes parallelism from the cluster's CPUs"}
    samples_per_shard: int = 10_000
    max_shard_bytes: int = 1_000_000_000
    min_shards: int = 4              # small data still makes this many shards: one per training worker (up to 4)
    # the reducers read a footer and a range of every map file: more map files than keep them under
    # this many requests per sample are first merged, a group at a time, into fewer files
    shuffle_requests_per_sample: float = 0.05
    merge_bytes: int = 4_000_000_000     # the map files one merge task holds on its local disk

    def validate(self, prefix: str) -> None:
        require(self.samples_per_shard >= 1, join(prefix, "samples_per_shard"), "must be >= 1")
        require(self.max_shard_bytes >= 10_000, join(prefix, "max_shard_bytes"), "must be >= 10000")
        require(self.min_shards >= 1, join(prefix, "min_shards"), "must be >= 1")
        require(self.shuffle_requests_per_sample > 0, join(prefix, "shuffle_requests_per_sample"), "must be > 0")
        require(self.merge_bytes >= 10_000_000, join(prefix, "merge_bytes"), "must be >= 10000000")


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info, io.BytesIO(data)


def write_shard(path: Path, samples: list[dict]) -> dict:
    """Write one shard atomically. samples: [{key, image (bytes), ext, caption, meta}] -> its index."""
    tmp = path.with_name(path.name + ".tmp")
    offsets = []
    with open(tmp, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for s in samples:
            offsets.append((s["key"], f.tell()))
            for ext, data in ((s["ext"], s["image"]), ("txt", s["caption"].encode()),
                              ("json", json.dumps(s["meta"], sort_keys=True, ensure_ascii=False).encode())):
                tar.addfile(*_member(f"{s['key']}.{ext}", data))
    os.replace(tmp, path)
    return {"offsets": offsets}


def _bytes_task(storage, file: str) -> int:
    t = read_kept(storage, file, ["size", "caption"])
    return int(pa.compute.sum(t.column("size")).as_py() or 0) + 1600 * t.num_rows


def _stored_size(data: bytes) -> tuple[int | None, int | None]:
    """Width and height of an image as ingest stored it, from its header (nothing is decoded)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except Exception:  # noqa: BLE001 - ingest decoded it already; a size we cannot read is not a drop
        return None, None


def _map_task(storage, part: str, file: str, seed: int, n_out: int) -> dict:
    """Ray task: one input partition's samples, images read once, into their output shards' buckets,
    a batch of images at a time (memory: a batch, whatever the partition's size)."""
    rows = by_location(read_kept(storage, file, ["key", "url", "caption", "notes", "tar", "member", "offset", "size",
                                                 "sha256", "width", "height"]))
    # one object per map task (infra/shuffle.py), not one per (partition, shard): about one per sample at scale
    out = BucketWriter(storage, f"{MAP_DIR}/{part}.parquet", MAP_SCHEMA, "shard")
    for batch, images in image_batches(storage, rows):
        keys = batch.column("key").to_pylist()
        order = [order_key(seed, k) for k in keys]
        shard = np.array([int(o[:16], 16) % n_out for o in order], np.int64)
        meta = []
        cols = (batch.column(x).to_pylist() for x in ("url", "caption", "notes", "sha256", "width", "height"))
        for k, img, (u, c, n, sha, ow, oh) in zip(keys, images, zip(*cols)):
            w, h = _stored_size(img)
            meta.append(json.dumps({"key": k, "url": u, "caption": c, "status": "success", "error_message": None,
                                    "width": w, "height": h, "original_width": ow, "original_height": oh,
                                    "sha256": sha, **(json.loads(n) if n else {})},
                                   sort_keys=True, ensure_ascii=False))
        ext = [(m or "x.jpg").rsplit(".", 1)[-1] for m in batch.column("member").to_pylist()]
        out.write(pa.table({"shard": pa.array(shard, pa.int32()), "key": keys, "order": order,
                            "image": pa.array(images, pa.binary()), "ext": ext, "caption": batch.column("caption"),
                            "meta": meta}, schema=MAP_SCHEMA))
    out.close()
    return {"part": part, "samples": rows.num_rows}


MAP_DIR = "shard/_work/map"
MAP_SCHEMA = pa.schema([("shard", pa.int32()), ("key", pa.string()), ("order", pa.string()), ("image", pa.binary()),
                        ("ext", pa.string()), ("caption", pa.string()), ("meta", pa.string())])


MERGE_DIR = "shard/_work/merged"


def merge_group(maps: int, shards: int, samples: int, cfg: ShardConfig, map_bytes: float) -> int:
    """How many map files one merged file joins: enough that the reducers' requests (a footer and
    a range of each file, for every output shard) stay under `shuffle_requests_per_sample`, within
    what one merge task may hold (`merge_bytes`). 1: no merge (small data)."""
    need = math.ceil(2 * maps * shards / max(1.0, samples * cfg.shuffle_requests_per_sample))
    fits = max(1, int(cfg.merge_bytes // max(1.0, map_bytes)))
    return max(1, min(need, fits, maps))


def _merge_task(storage, files: list[str], rel_out: str) -> dict:
    """Ray task: map files read whole (one stream each, not a range per shard) into a local folder,
    written back as one file with a row group per output shard: the reducers open one file where
    there were len(files). Rows keep the files' order within a shard (the reducer sorts anyway)."""
    import shutil
    import tempfile

    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory(prefix="capline-merge-") as tmp:
        local = []
        for i, rel in enumerate(files):
            path = Path(tmp) / f"{i:05d}.parquet"
            with storage.fs.open_input_stream(storage.path(rel)) as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst, 64 << 20)
            local.append(pq.ParquetFile(path))
        groups: dict[int, list[tuple[int, int]]] = {}
        for i, pf in enumerate(local):          # each row group holds one shard (infra/shuffle.py)
            col = pf.schema_arrow.get_field_index("shard")
            for g in range(pf.metadata.num_row_groups):
                st = pf.metadata.row_group(g).column(col).statistics
                if st is not None and st.has_min_max:
                    groups.setdefault(st.min, []).append((i, g))
        out, rows = BucketWriter(storage, rel_out, MAP_SCHEMA, "shard"), 0
        for shard in sorted(groups):
            t = pa.concat_tables([local[i].read_row_group(g) for i, g in groups[shard]])
            out.write(t)                 # one shard: one row group
            rows += t.num_rows
        out.close()
    return {"files": len(files), "rows": rows}


def _reduce_task(storage, shard: int, maps: list[str]) -> dict:
    """Ray task: one output shard from the map files' row groups: the tar, its index, its ledger partition."""
    t = read_bucket(storage, maps, "shard", shard, MAP_SCHEMA).sort_by("order")
    name = f"{shard:06d}.tar"
    buf = io.BytesIO()
    offsets = []
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for k, img, ext, cap, meta in zip(*(t.column(c).to_pylist() for c in ("key", "image", "ext", "caption", "meta"))):
            offsets.append(buf.tell())
            for e, data in ((ext, img), ("txt", (cap or "").encode()), ("json", meta.encode())):
                tar.addfile(*_member(f"{k}.{e}", data))
    data = buf.getvalue()
    sha = storage.write_bytes(f"shard/shards/{name}", data)
    md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()   # wids' index field
    keys = t.column("key").to_pylist()
    storage.write_table(f"shard/index/{shard:06d}.parquet",
                        pa.table({"key": keys, "shard": [name] * len(keys), "offset": pa.array(offsets, pa.int64())}))
    ledger = pa.table({"key": keys, "verdict": [KEPT] * len(keys), "reason": [""] * len(keys),
                       "caption": t.column("caption"), "tar": [f"shard/shards/{name}"] * len(keys),
                       "offset": pa.array(offsets, pa.int64())})
    return write_part(storage, "shard", f"{shard:06d}", None, keys, ledger,
                      extra={"name": name, "samples": len(keys), "bytes": len(data), "sha256": sha, "md5": md5})


class ShardStage(Sink):
    """A sink that places samples: its ledger (a partition per output shard) says where each went."""
    name = "shard"
    config_key, config_class = "shard", ShardConfig
    final_data = True

    def run(self, ctx: StageContext) -> StageResult:
        cfg: ShardConfig = ctx.cfg
        upstream = [u for u in ctx.upstream or [] if u.kept]
        n = ctx.n_in
        if not n:
            raise RuntimeError("shard: no samples left to write; every sample was dropped upstream")
        sizes = ctx.run(_bytes_task, [(ctx.storage, u.file) for u in upstream], "shard plan", num_cpus=0.25,
                        quiet=True)
        n_out = max(1, math.ceil(n / cfg.samples_per_shard), math.ceil(sum(sizes) / (0.9 * cfg.max_shard_bytes)))
        if n_out < cfg.min_shards:   # small data: each training worker still gets a shard of its own
            ctx.log(f"shard: {n} samples make {n_out} shard(s) of {cfg.samples_per_shard}; writing "
                    f"{min(cfg.min_shards, n)} (stages.shard.min_shards), one per training worker")
            n_out = max(n_out, min(cfg.min_shards, n))
        maps = {u.part: f"{MAP_DIR}/{u.part}.parquet" for u in upstream}
        done = set(ctx.storage.list(MAP_DIR, ".parquet"))     # written whole: a map file is a finished map
        todo = [u for u in upstream if maps[u.part] not in done]
        ctx.run(_map_task, [(ctx.storage, u.part, u.file, ctx.seed, n_out) for u in todo], "shard map",
                num_cpus=1, describe=lambda c: f"partition {c[1]}")
        map_files = sorted(maps.values())
        per = merge_group(len(map_files), n_out, n, cfg, sum(sizes) / max(1, len(map_files)))
        if per > 1:     # many map files: fewer, larger files for the reducers to open
            groups = [map_files[i:i + per] for i in range(0, len(map_files), per)]
            merged = [f"{MERGE_DIR}/{i:06d}.parquet" for i in range(len(groups))]
            have = set(ctx.storage.list(MERGE_DIR, ".parquet"))
            ctx.run(_merge_task, [(ctx.storage, g, m) for g, m in zip(groups, merged) if m not in have],
                    "shard merge", num_cpus=1, unit="merges")
            ctx.log(f"shard: {len(map_files)} map files merged into {len(merged)} for {n_out} reducers")
            map_files = merged
        parts = ctx.run(_reduce_task, [(ctx.storage, i, map_files) for i in range(n_out)], "shard write",
                        num_cpus=1, describe=lambda c: f"shard {c[1]:06d}", unit="shards")
        names = {p.extra["name"] for p in parts}
        for stale in ctx.storage.list("shard/shards", ".tar"):
            if stale.rsplit("/", 1)[-1] not in names:
                ctx.storage.delete(stale)   # shards of an earlier, larger plan
        for stale in ctx.storage.list("shard/index", ".parquet"):
            if stale.rsplit("/", 1)[-1][:-8] + ".tar" not in names:
                ctx.storage.delete(stale)
        ctx.storage.delete("shard/_work")
        shards = [{k: p.extra[k] for k in ("name", "samples", "bytes", "sha256")} for p in parts]
        files = {f"shard/shards/{s['name']}": s["sha256"] for s in shards}
        index = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": ctx.run_name,
                 "shardlist": [{"url": s["name"], "nsamples": s["samples"], "filesize": s["bytes"],
                                "md5sum": p.extra["md5"]} for s, p in zip(shards, parts)]}
        for rel, obj in (("shard/shards/sizes.json", {s["name"]: s["samples"] for s in shards}),
                         ("shard/shards/shardindex.json", index), ("shard/shards.json", shards)):
            files[rel] = ctx.storage.write_bytes(rel, json.dumps(obj, indent=1).encode())
        ctx.log(f"shard: {n} samples in {len(shards)} shards")
        return StageResult(parts, {"shards": len(shards), "bytes": sum(s["bytes"] for s in shards)},
                           artifacts={"folder": "shard/shards", "shards": shards,
                                      "train_data": train_data_pattern(ctx.storage, shards)},
                           files=files)


def train_data_pattern(storage, shards: list[dict]) -> str:
    """The brace pattern open_clip's and webdataset's --train-data takes for these shards."""
    names = sorted(s["name"] for s in shards)
    first, last = names[0][:-4], names[-1][:-4]
    body = first if first == last else f"{{{first}..{last}}}"
    return storage.uri(f"shard/shards/{body}.tar")
