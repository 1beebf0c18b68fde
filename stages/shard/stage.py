"""The shard stage: the kept samples as final WebDataset shards, byte-reproducible.

Order: a global shuffle by sha256(seed:key), independent of arrival order and worker count: a
sample goes to output shard (that hash mod the number of shards), and each shard holds its samples
in hash order. The shuffle goes through Ray's object store (Executor.shuffle), never the run
folder: a map task per slice of an input partition (at most `map_bytes` of images, in tar order)
reads its images once through the sample index and cuts a piece per reducer, which Ray Data's hash
shuffle hands on; a reducer per group of consecutive output shards (a shard each, unless maps x
shards would pass `shuffle_pieces` pieces) writes each shard's tar, its index and its ledger
partition, and records the tar's sha256. The driver only counts and holds references.
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
import re
import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from infra.configtools import join, require
from infra.errors import UserError
from infra.faults import killpoint
from infra.remote import Stored

from . import line_lookup
from ..base import KEPT, Sink, StageContext, StageResult
from ..dataplane import ROWS_PER_WORKER, PartResult, bucket_pieces, by_location, image_batches, read_kept, write_part
from .removals import ENDED_REMOVALS, REMOVED
from .line import (LINE, PUBLISHED, PUBLISHED_SCHEMA, RECORD, published_all, published_file, published_names,
                   published_parts,
                   published_state, read_line, read_states, write_states)
from infra.hashing import order_key
from infra.tars import SampleTarWriter


@dataclass
class ShardConfig:
    # how the work is cut or run, never what is decided: left out of the fingerprint and the card
    HOW: ClassVar[tuple] = ("map_bytes", "shuffle_pieces")
    REMOVED: ClassVar[dict] = {"num_workers": "the executor sizes parallelism from the cluster's CPUs",
                               "shuffle_requests_per_sample": "the shuffle goes through Ray's object store: "
                                                              "no map file is merged or read back",
                               "merge_bytes": "the shuffle goes through Ray's object store: no map file is merged"}
    samples_per_shard: int = 10_000  # samples per final WebDataset shard
    max_shard_bytes: int = 1_000_000_000  # a shard is closed before it grows past this many bytes
    min_shards: int = 4              # small data still makes this many shards: one per training worker (up to 4)
    map_bytes: int = 256 * 2**20     # image bytes one map task reads and holds (a partition is cut in slices of this)
    # pieces the shuffle moves (map slices x reducers, a row of Ray Data's shuffle each, empty ones
    # too): past this, a reducer writes several consecutive shards, so the shuffle moves fewer
    shuffle_pieces: int = 1_000_000
    # a dataset line that only grows (scheduled runs over an appended URL list): the shards earlier
    # runs published stay as they are, byte for byte, and only samples not in them go to new shards,
    # numbered after them; the manifest names the shards each run added (stages/shard/line.py).
    # false: every run writes every shard anew (the same shards as one run over all the data)
    append: bool = False

    def validate(self, prefix: str) -> None:
        require(self.samples_per_shard >= 1, join(prefix, "samples_per_shard"), "must be >= 1")
        require(self.max_shard_bytes >= 10_000, join(prefix, "max_shard_bytes"), "must be >= 10000")
        require(self.min_shards >= 1, join(prefix, "min_shards"), "must be >= 1")
        require(self.map_bytes >= 65536, join(prefix, "map_bytes"), "must be >= 65536")
        require(self.shuffle_pieces >= 1, join(prefix, "shuffle_pieces"), "must be >= 1")


def _new_rows(storage, t: pa.Table, part: str, line_shards: frozenset | None,
              record: pa.Table | None = None) -> tuple[pa.Table, pa.Table]:
    """-> (the rows of t not yet in a shard of the line, the partition's published (key, shard) rows).
    `record`: the partition's published record, if the caller read it already."""
    if line_shards is None:
        return t, PUBLISHED_SCHEMA.empty_table()
    if record is None:
        record = published_all(storage, part)
    published = record.filter(pc.is_in(record.column("shard"), pa.array(sorted(line_shards), pa.string())))
    return t.filter(pc.invert(pc.is_in(t.column("key"), published.column("key")))), published


# what the shard writers and the dataset line's records read of a sample
PLACED_COLUMNS = ["key", "url", "caption", "notes", "tar", "member", "offset", "size", "sha256", "width", "height"]


@dataclass
class Plan:
    """A partition's plan: what it brings to new shards and, in a dataset line, how many samples it
    published before that are no longer kept (the first by key, to name). `stored`: the rows to
    place, in tar order, and the partition's published rows, in the object store for the shard
    writers and the line's records: the partition is read once, by the plan."""
    samples: int
    bytes: int
    withdrawn: int
    first_withdrawn: str | None
    stored: Stored = field(default_factory=Stored, repr=False)


def _plan_task(storage, part: str, file: str, line_shards: frozenset | None) -> Plan:
    """Ray task: what a partition brings to new shards (samples, bytes) and, in a dataset line,
    how many samples it published before that are no longer kept (the first by key, to name)."""
    t = read_kept(storage, file, PLACED_COLUMNS)
    record = published_all(storage, part) if line_shards is not None else None
    new, published = _new_rows(storage, t, part, line_shards, record)
    gone = published.filter(pc.invert(pc.is_in(published.column("key"), t.column("key")))).column("key")
    return Plan(samples=new.num_rows, bytes=int(pc.sum(new.column("size")).as_py() or 0) + 1600 * new.num_rows,
                withdrawn=len(gone), first_withdrawn=pc.min(gone).as_py(), stored=Stored((by_location(new), published)))


def _stored_size(data: bytes) -> tuple[int | None, int | None]:
    """Width and height of an image as ingest stored it, from its header (nothing is decoded)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except Exception:  # noqa: BLE001 - ingest decoded it already; a size we cannot read is not a drop
        return None, None


def _placement(seed: int, keys: list[str], first: int, n_out: int) -> tuple[list[str], np.ndarray]:
    """Each key's order (sha256 of seed:key) and output shard: from the key alone."""
    order = [order_key(seed, k) for k in keys]
    return order, np.array([first + int(o[:16], 16) % n_out for o in order], np.int64)


def _map_pieces(storage, part: str, planned: tuple, seed: int, first: int, n_out: int, per_group: int, groups: int,
                lo: int, hi: int) -> list[pa.Table]:
    """Ray task (the shuffle's map): rows [lo, hi) of one partition's samples to place (`planned`: the
    plan's rows, in tar order; in a dataset line only those not yet published, `_publish_task`
    records where they went once the shards are written), images read once, a batch at a time, cut
    into `groups` pieces (reducer g takes shards first + g*per_group ...)."""
    rows = planned[0]
    pieces: list[list[pa.Table]] = [[] for _ in range(groups)]      # per reducer, a piece per batch
    for batch, images in image_batches(storage, rows.slice(lo, hi - lo)):
        keys = batch.column("key").to_pylist()
        order, shard = _placement(seed, keys, first, n_out)
        meta = []
        cols = (batch.column(x).to_pylist() for x in ("url", "caption", "notes", "sha256", "width", "height"))
        for k, img, (u, c, n, sha, ow, oh) in zip(keys, images, zip(*cols)):
            w, h = _stored_size(img)
            meta.append(json.dumps({"key": k, "url": u, "caption": c, "status": "success", "error_message": None,
                                    "width": w, "height": h, "original_width": ow, "original_height": oh,
                                    "sha256": sha, **(json.loads(n) if n else {})},
                                   sort_keys=True, ensure_ascii=False))
        ext = [(m or "x.jpg").rsplit(".", 1)[-1] for m in batch.column("member").to_pylist()]
        t = pa.table({"shard": pa.array(shard, pa.int32()), "key": keys, "order": order,
                      "image": pa.array(images, pa.binary()), "ext": ext, "caption": batch.column("caption"),
                      "meta": meta}, schema=MAP_SCHEMA)
        for g, piece in enumerate(bucket_pieces(t, (shard - first) // per_group, groups)):
            if piece.num_rows:
                pieces[g].append(piece)
    return [pa.concat_tables(p) if p else MAP_SCHEMA.empty_table() for p in pieces]


MAP_SCHEMA = pa.schema([("shard", pa.int32()), ("key", pa.string()), ("order", pa.string()), ("image", pa.binary()),
                        ("ext", pa.string()), ("caption", pa.string()), ("meta", pa.string())])


def _reduce_group(storage, shards: list[int], *pieces: pa.Table) -> list:
    """Ray task (the shuffle's reduce): consecutive output shards from their pieces of every map, each
    in hash order: the tars, their indexes and ledger partitions."""
    t = pa.concat_tables(pieces) if pieces else MAP_SCHEMA.empty_table()
    t = t.sort_by([("shard", "ascending"), ("order", "ascending")])
    col = t.column("shard").to_numpy()
    ends = np.searchsorted(col, np.array(shards + [shards[-1] + 1]))
    return [write_shard_table(storage, s, t.slice(int(ends[i]), int(ends[i + 1] - ends[i])))
            for i, s in enumerate(shards)]


def shard_bytes(samples) -> tuple[bytes, list[int]]:
    """A shard's tar from its samples in order, (key, image bytes, ext, caption, meta JSON) each:
    fixed USTAR headers (infra/tars.py), so the same samples are the same bytes. -> (the tar, each
    sample's first header's offset)."""
    buf = io.BytesIO()
    offsets = []
    with SampleTarWriter(buf) as tar:
        for k, img, ext, cap, meta in samples:
            offsets.append(tar.add(k, [(ext, img), ("txt", (cap or "").encode()), ("json", meta.encode())]))
    return buf.getvalue(), offsets


def write_shard_table(storage, shard: int, t: pa.Table):
    """Shard `shard` from its samples in order (key, image, ext, caption, meta): the tar, its index
    and its ledger partition; -> the ledger's PartResult, the tar's name, samples, bytes, sha256 and
    md5 in its extra. The one tar writer of the stage and of removals (pipeline/remove.py)."""
    name = f"{shard:06d}.tar"
    data, offsets = shard_bytes(zip(*(t.column(c).to_pylist() for c in ("key", "image", "ext", "caption", "meta"))))
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


SHARD_NAME = re.compile(r"[0-9]{6}\.tar")


def next_shard(listed: list[dict]) -> int:
    """The number of a dataset line's next shard: after the highest it lists (a line whose record
    skips a number never reuses one)."""
    return 1 + max((int(s["name"][:6]) for s in listed), default=-1)


class ShardStage(Sink):
    """A sink that places samples: its ledger (a partition per output shard) says where each went."""
    name = "shard"
    config_key, config_class = "shard", ShardConfig
    final_data = True
    reads_sinks_before = False     # images and captions as text: the tokenizer is training's, not the shards'
    # a dataset line's shards, their indexes and ledger partitions outlive a change of input (stale
    # ones are deleted by name below); the line's record with them
    preserve = ("shards", "index", "ledger", "line")

    def preflight(self, config) -> None:
        if config.stages.shard.append:
            check_line_settings(config)

    def run(self, ctx: StageContext) -> StageResult:
        cfg: ShardConfig = ctx.cfg
        n = ctx.n_in
        if not n:
            raise RuntimeError("shard: no samples left to write; every sample was dropped upstream")
        line = self._line(ctx)
        old = line["shards"] if line else []
        line_shards = frozenset(s["name"] for s in old) if cfg.append else None
        states = read_states(ctx.storage) if line else None
        published = published_parts(ctx.storage, states) if line else set()
        gone = sorted(published - {u.part for u in ctx.upstream or []})
        if gone:
            raise UserError(f"stages.shard.append: {len(gone)} input partition(s) that earlier runs of this dataset "
                            f"line published from are not in this run (first: {gone[0]}); a dataset line only grows: "
                            "keep its URL files as they were and add new ones, or set stages.shard.append=false "
                            "to write every shard anew")
        upstream = [u for u in ctx.upstream or [] if u.kept or u.part in published]
        # a partition that kept the same samples when the line last published from it has nothing new
        runs = {r["run"] for r in line["runs"]} if line else set()
        # one table (a line published before it: a record per partition, read 32 at a time)
        seen = states if states is not None else dict(zip(published, ctx.storage.read_jsons(
            [published_state(p) for p in sorted(published)])))
        same = {u.part for u in upstream if (seen.get(u.part) or {}).get("run") in runs
                and (seen[u.part]["kept"], seen[u.part]["kept_sum"]) == (u.kept, u.kept_sum)}
        if same:
            ctx.log(f"shard: {len(same)} partitions keep what this dataset line published from them; "
                    f"{len(upstream) - len(same)} to place")
        upstream = [u for u in upstream if u.part not in same]
        plans = ctx.run(_plan_task, [(ctx.storage, u.part, u.file, line_shards) for u in upstream], "shard plan",
                        num_cpus=0.25, quiet=True, sizes=[u.kept for u in upstream], items_per_worker=ROWS_PER_WORKER)
        # a published record may name a shard line.json does not list: a run killed before it wrote
        # line.json (_line refused a record behind sizes.json or the versions, so that is all it can
        # be); those samples are not published and are placed again, into the same names
        withdrawn = [p for p in plans if p.withdrawn]
        if withdrawn:
            first = min(p.first_withdrawn for p in withdrawn)
            raise UserError(f"stages.shard.append: {sum(p.withdrawn for p in withdrawn)} sample(s) published by "
                            f"earlier runs of this dataset line are no longer kept (first: {first}; `capline explain "
                            f"{first}` says why), and published shards do not change: restore what kept them (the "
                            "filters' settings, stages.clip_score.reuse_cut, the evaluation sets) or set "
                            "stages.shard.append=false to write every shard anew")
        todo = [(u, p) for u, p in zip(upstream, plans) if p.samples]
        n_new = sum(p.samples for _, p in todo)
        first = next_shard(old)
        parts = [PartResult.from_json(s["result"]) for s in old]
        n_out = 0
        if n_new:
            made, n_out = self._write(ctx, cfg, todo, n_new, sum(p.bytes for _, p in todo), first, line_shards)
            parts += made
        elif old:
            ctx.log(f"shard: every kept sample is in this dataset line's {len(old)} shards already; no shard added")
        added = parts[len(old):]
        shards = old + [{**{k: p.extra[k] for k in ("name", "samples", "bytes", "sha256", "md5")},
                         "result": p.to_json()} for p in added]
        self._delete_stale(ctx, {s["name"] for s in shards})
        killpoint("shard: shards written")
        if cfg.append:      # the new shards are published once the line lists them: last
            self._publish(ctx, line, todo, shards, [s["name"] for s in shards[len(old):]], n_new,
                          {p: seen[p] for p in published if seen.get(p)}, (first, n_out, line_shards))
        ctx.storage.delete("shard/_work")
        listed = [{k: s[k] for k in ("name", "samples", "bytes", "sha256")} for s in shards]
        files = {f"shard/shards/{s['name']}": s["sha256"] for s in listed}
        index = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": ctx.run_name,
                 "shardlist": [{"url": s["name"], "nsamples": s["samples"], "filesize": s["bytes"],
                                "md5sum": s["md5"]} for s in shards]}
        for rel, obj in (("shard/shards/sizes.json", {s["name"]: s["samples"] for s in listed}),
                         ("shard/shards/shardindex.json", index), ("shard/shards.json", listed)):
            files[rel] = ctx.storage.write_bytes(rel, json.dumps(obj, indent=1).encode())
        ctx.log(f"shard: {n} samples in {len(listed)} shards"
                + (f"; this run added {len(added)} ({n_new} samples)" if cfg.append else ""))
        added_names = [s["name"] for s in shards[len(old):]]
        return StageResult(parts, {"shards": len(listed), "bytes": sum(s["bytes"] for s in listed),
                                   **({"added": len(added_names), "added_samples": n_new} if cfg.append else {})},
                           artifacts={"folder": "shard/shards", "shards": listed,
                                      "train_data": train_data_pattern(ctx.storage, listed),
                                      **({"added": added_names} if cfg.append else {})},
                           files=files)

    def _line(self, ctx: StageContext) -> dict | None:
        """The dataset line's record (append), or none: without append, a line kept before is dropped."""
        line = read_line(ctx.storage)
        if ctx.cfg.append:
            if line is None and ctx.storage.list(PUBLISHED):
                # the line's record is gone or torn while what it published is recorded: going on would
                # write every published shard anew and drop samples the line had published
                raise UserError(f"shard: {ctx.storage.uri(RECORD)} is missing or unreadable, but the dataset line's "
                                f"published records are there ({ctx.storage.uri(PUBLISHED)}/); restore line.json, or "
                                "set stages.shard.append: false to end the line and write every shard anew")
            if line is not None:
                names = [s.get("name") if isinstance(s, dict) else None for s in line.get("shards") or []] \
                    if isinstance(line, dict) else [None]
                odd = [n for n in names if not (isinstance(n, str) and SHARD_NAME.fullmatch(n))]
                if odd or len(set(names)) != len(names) or not isinstance(line.get("runs"), list):
                    raise UserError(f"shard: {ctx.storage.uri(RECORD)} is not a dataset line's record (shards named "
                                    "NNNNNN.tar, each once, and its runs); restore the line's own line.json, or set "
                                    "stages.shard.append: false to end the line and write every shard anew")
                have = {f.rsplit("/", 1)[-1] for f in ctx.storage.list("shard/shards", ".tar")}
                lost = sorted(s["name"] for s in line["shards"] if s["name"] not in have)
                if lost:
                    raise UserError(f"shard: the dataset line's published shard(s) {', '.join(lost[:3])} are missing "
                                    f"from {ctx.storage.uri('shard/shards')}; restore them (`capline verify` checks the "
                                    "rest), or set stages.shard.append: false to end the line and write every shard anew")
                behind = sorted(published_names(ctx.storage) - set(names))
                if behind:
                    # published shards are write-once: a record behind the bucket would number new
                    # shards over them (a kill before line.json leaves only unpublished ones)
                    raise UserError(f"shard: {ctx.storage.uri(RECORD)} does not list shard(s) {', '.join(behind[:3])} "
                                    "that this dataset line published (its sizes.json or a removal's versions name "
                                    "them): the record is stale or not this line's, and going on would write new shards "
                                    "over published ones; nothing was written. Restore the line's latest line.json (`capline verify "
                                    "RUN_DIR` compares it with the shards)")
            if line is None and ctx.storage.list("shard/shards", ".tar"):
                ctx.log("shard: starting a dataset line (stages.shard.append); the shards of an earlier run "
                        "are written anew, and from now on only added to")
            return line
        if line is not None:
            ctx.log(f"shard: stages.shard.append is off: the dataset line of {len(line['shards'])} shards ends; "
                    "every shard is written anew" + ("; its removals stay in force" if line.get("removals") else ""))
            # ending a line never undoes a takedown: removed.parquet and the removals' records stay,
            # and every later run (and a line started again) applies them
            ended = (ctx.storage.read_json(ENDED_REMOVALS) or []) + (line.get("removals") or [])
            ctx.storage.delete_files([f for f in ctx.storage.list(LINE, recursive=True)
                                      if f not in (REMOVED, ENDED_REMOVALS)])
            if ended:
                ctx.storage.write_json(ENDED_REMOVALS, ended)
        return None

    def _write(self, ctx: StageContext, cfg: ShardConfig, upstream: list, n: int, nbytes: int, first: int,
               line_shards: frozenset | None) -> tuple[list[PartResult], int]:
        """The shuffle: n samples (nbytes) of these (partition, plan) pairs into new shards numbered
        from first; -> (the shards' ledger partitions, how many shards)."""
        n_out = max(1, math.ceil(n / cfg.samples_per_shard), math.ceil(nbytes / (0.9 * cfg.max_shard_bytes)))
        if n_out < cfg.min_shards and not first:   # small data: each training worker still gets a shard of its own
            ctx.log(f"shard: {n} samples make {n_out} shard(s) of {cfg.samples_per_shard}; writing "
                    f"{min(cfg.min_shards, n)} (stages.shard.min_shards), one per training worker")
            n_out = max(n_out, min(cfg.min_shards, n))
        # map slices of at most map_bytes of images each: (partition, first row, end row)
        slices = []
        for u, p in upstream:
            k = max(1, math.ceil(p.bytes / cfg.map_bytes))
            step = math.ceil(p.samples / k)
            slices += [(u, p, lo, min(p.samples, lo + step)) for lo in range(0, p.samples, step)]
        per_group = max(1, math.ceil(len(slices) * n_out / cfg.shuffle_pieces))
        groups = math.ceil(n_out / per_group)
        if per_group > 1:
            ctx.log(f"shard: {len(slices)} map slices x {n_out} shards would be over stages.shard.shuffle_pieces "
                    f"({cfg.shuffle_pieces}) objects: each reducer writes {per_group} consecutive shards")
        reducers = [[s for s in range(first + g * per_group, min(first + n_out, first + (g + 1) * per_group))]
                    for g in range(groups)]
        made = ctx.shuffle(_map_pieces, [(ctx.storage, u.part, p.stored.handle(), ctx.seed, first, n_out, per_group, groups,
                                          lo, hi) for u, p, lo, hi in slices],
                           groups, _reduce_group, [(ctx.storage, r) for r in reducers], "shard write",
                           num_cpus=1, unit="reducers", sizes=[hi - lo for _, _, lo, hi in slices],
                           items_per_worker=ROWS_PER_WORKER)
        return [p for group in made for p in group], n_out

    def _delete_stale(self, ctx: StageContext, names: set[str]) -> None:
        """Shards and indexes of an earlier, larger plan (not this run's or the line's)."""
        for folder, suffix in (("shard/shards", ".tar"), ("shard/index", ".parquet")):   # the runner: ledger/
            ctx.storage.delete_files([stale for stale in ctx.storage.list(folder, suffix)
                                      if stale.rsplit("/", 1)[-1][:-len(suffix)] + ".tar" not in names])

    def _publish(self, ctx: StageContext, line: dict | None, planned: list, shards: list[dict], added: list[str],
                 n_new: int, seen: dict[str, dict], placed: tuple) -> None:
        """The partitions' published keys, their states in one table, then the line's record (its last
        write: what it lists is published). `planned`: (partition, its Plan) of those placed;
        `placed`: (first new shard, new shards, the line's shards before), as the shuffle placed the
        new samples."""
        mapped = [u for u, _ in planned]
        run = len((line or {}).get("runs", [])) + 1
        first, n_out, line_shards = placed
        # the published records, and this run's lookup of what it added (stages/shard/line_lookup.py)
        buckets = line_lookup.buckets_for(n_new)
        ctx.shuffle(_publish_task, [(ctx.storage, u.part, p.stored.handle(), ctx.seed, first, n_out, buckets)
                                    for u, p in planned], buckets, line_lookup.write_bucket,
                    [(ctx.storage, line_lookup.bucket_file(run, b)) for b in range(buckets)], "shard publish",
                    num_cpus=0.25, unit="buckets", sizes=[u.kept for u, _ in planned], items_per_worker=ROWS_PER_WORKER)
        write_states(ctx.storage, {**seen, **{u.part: {"kept": u.kept, "kept_sum": u.kept_sum, "run": run}
                                              for u in mapped}})
        runs = (line or {}).get("runs", []) + [{"run": run, "added": added,
                                                 "samples": n_new, "lookup": buckets,
                                                 "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]
        # everything else the line records (its removals) stays as it is
        # a line started again carries the removals of the one that ended before it
        started = {} if line else {"removals": ctx.storage.read_json(ENDED_REMOVALS) or []}
        killpoint("shard: records published")
        ctx.storage.write_json(RECORD, {**started, **(line or {}), "shards": shards, "runs": runs})
        killpoint("shard: line written")


def _publish_task(storage, part: str, planned: tuple, seed: int, first: int, n_out: int,
                  buckets: int) -> list[pa.Table]:
    """Ray task (the publish shuffle's map): a partition's published keys after this run, where the
    line keeps them: what it had published and where this run placed the rest (from the keys alone,
    as the shuffle placed them; `planned`: the plan's rows to place, in tar order, and its published
    rows); -> the lookup rows of what it added, in `buckets` pieces."""
    new, published = planned
    keys = new.column("key").to_pylist()
    _, shard = _placement(seed, keys, first, n_out)
    names = [f"{s:06d}.tar" for s in shard]
    storage.write_table(published_file(part), pa.concat_tables(
        [published, pa.table({"key": keys, "shard": names}, schema=PUBLISHED_SCHEMA)]))
    return line_lookup.pieces(part, keys, new.column("url").to_pylist(), new.column("sha256").to_pylist(), names,
                              buckets)


def check_line_settings(config) -> None:
    """An append-only dataset line keeps what it published: the filters that decide must decide the
    same for a sample in every run. Refuse, before anything runs, the settings that would not."""
    cs = config.stages.clip_score
    if cs.enabled and cs.threshold is None and not cs.reuse_cut:
        raise UserError("stages.shard.append: stages.clip_score.keep_fraction recomputes its cut every run, which "
                        "can drop samples the line published; set stages.clip_score.reuse_cut=true (keep the "
                        "line's cut) or a fixed stages.clip_score.threshold")
    if cs.enabled and cs.scorer == "bootstrap" and not cs.bootstrap.reuse:
        raise UserError("stages.shard.append: the bootstrap scorer is trained anew every run, so every score can "
                        "move; set stages.clip_score.bootstrap.reuse=true (the line's scorer) or a fixed "
                        "scorer (stages.clip_score.scorer: checkpoint, hf or column)")


def train_data_pattern(storage, shards: list[dict]) -> str:
    """The brace pattern open_clip's and webdataset's --train-data takes for these shards."""
    names = sorted(s["name"] for s in shards)
    first, last = names[0][:-4], names[-1][:-4]
    body = first if first == last else f"{{{first}..{last}}}"
    return storage.uri(f"shard/shards/{body}.tar")
