"""The shard stage: the kept samples as final WebDataset shards, byte-reproducible.

Order: a global shuffle by sha256(seed:key), independent of arrival order and worker count.
Each sample is `<key>.jpg` (the bytes ingest stored), `<key>.txt` (the caption) and `<key>.json`
(key, source URL, caption, scores and verdict details from every earlier stage). Tar members have
mtime 0, owner 0:0, mode 0444 and USTAR headers, so equal content gives equal bytes. Shards hold
`samples_per_shard` samples or stop before `max_shard_bytes`; each is written as `.tmp` and renamed
when complete. Beside them: `sizes.json` (shard -> samples, as open_clip reads), `shards.json`
(name, samples, bytes, sha256 per shard) and `index.parquet` (key -> shard, byte offset of the
sample's first member) so a reader can count and seek.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from trainers.configtools import join, require

from .base import Ledger, Stage, StageContext, StageResult
from .captions import caption_map
from .tokenizer import order_key


@dataclass
class ShardConfig:
    samples_per_shard: int = 10_000
    max_shard_bytes: int = 1_000_000_000
    num_workers: int = 2

    def validate(self, prefix: str) -> None:
        require(self.samples_per_shard >= 1, join(prefix, "samples_per_shard"), "must be >= 1")
        require(self.max_shard_bytes >= 10_000, join(prefix, "max_shard_bytes"), "must be >= 10000")
        require(self.num_workers >= 1, join(prefix, "num_workers"), "must be >= 1")


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


def ingest_locations(ingest_dir: Path) -> dict[str, tuple[str, str]]:
    """key -> (ingest shard path, img2dataset key), from the ingest ledger's details."""
    t = pq.read_table(ingest_dir / "ledger.parquet", columns=["key", "verdict", "detail"]).to_pylist()
    out = {}
    for r in t:
        if r["verdict"] == "kept":
            part, shard, i2d_key = r["detail"].split("/")
            out[r["key"]] = (str(ingest_dir / "parts" / part / "shards" / f"{shard}.tar"), i2d_key)
    return out


def _task():
    import ray

    @ray.remote
    def build(path: str, plan: list[dict]) -> dict:
        """plan: [{key, tar, member, caption, meta}] in output order; reads images from ingest tars."""
        by_tar: dict[str, list[dict]] = {}
        for p in plan:
            by_tar.setdefault(p["tar"], []).append(p)
        images = {}
        for tar_path, items in by_tar.items():
            wanted = {f"{p['member']}.jpg": p["key"] for p in items}
            with tarfile.open(tar_path) as tar:
                for m in tar:
                    if m.name in wanted:
                        images[wanted[m.name]] = tar.extractfile(m).read()
        samples = [{"key": p["key"], "image": images[p["key"]], "ext": "jpg", "caption": p["caption"],
                    "meta": p["meta"]} for p in plan]
        index = write_shard(Path(path), samples)
        return {"name": Path(path).name, "offsets": index["offsets"]}

    return build


class ShardStage(Stage):
    name = "shard"

    def section(self, config) -> ShardConfig:
        return config.stages.shard

    def run(self, ctx: StageContext) -> StageResult:
        import hashlib

        import ray

        cfg: ShardConfig = ctx.config.stages.shard
        keys = sorted(ctx.upstream_kept or [], key=lambda k: order_key(ctx.config.seed, k))
        ledger = Ledger(self.name)
        src = pq.read_table(ctx.upstream["source"] / "urls.parquet", columns=["key", "url"]).to_pydict()
        url_of = dict(zip(src["key"], src["url"]))
        caption_of = caption_map(ctx.upstream)
        where = ingest_locations(ctx.upstream["ingest"])
        extra = _stage_notes(ctx)
        out_dir = ctx.stage_dir / "shards"
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob("*.tmp"):
            stale.unlink()
        # plan shards: by count, and by bytes using the ingest images' sizes
        sizes = _image_sizes(set(where[k][0] for k in keys))
        plans, current, current_bytes = [], [], 0
        for k in keys:
            tar_path, member = where[k]
            nbytes = sizes.get((tar_path, member), 0) + len(caption_of[k]) + 1536  # headers and json
            if current and (len(current) >= cfg.samples_per_shard or current_bytes + nbytes > cfg.max_shard_bytes):
                plans.append(current)
                current, current_bytes = [], 0
            meta = {"key": k, "url": url_of[k], "caption": caption_of[k], **extra.get(k, {})}
            current.append({"key": k, "tar": tar_path, "member": member, "caption": caption_of[k], "meta": meta})
            current_bytes += nbytes
            ledger.keep(k)
        if current:
            plans.append(current)
        build = _task()
        names = [f"{i:06d}.tar" for i in range(len(plans))]
        done = {n for n in names if (out_dir / n).is_file()}
        refs = [build.remote(str(out_dir / n), p) for n, p in zip(names, plans) if n not in done]
        results = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            r = ray.get(ready[0])
            results[r["name"]] = r
            ctx.log(f"shard: {len(done) + len(results)}/{len(plans)} shards written")
        for n in sorted(set(names) - set(os.listdir(out_dir))):
            raise RuntimeError(f"shard: {n} missing after writing")
        for stale in set(os.listdir(out_dir)) - set(names):
            (out_dir / stale).unlink()  # shards of an earlier, larger plan
        shards, index_rows = [], {"key": [], "shard": [], "offset": []}
        for n, plan in zip(names, plans):
            data = (out_dir / n).read_bytes()
            shards.append({"name": n, "samples": len(plan), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            offsets = results[n]["offsets"] if n in results else _offsets(out_dir / n)
            for key, off in offsets:
                index_rows["key"].append(key)
                index_rows["shard"].append(n)
                index_rows["offset"].append(off)
        (ctx.stage_dir / "sizes.json").write_text(json.dumps({s["name"]: s["samples"] for s in shards}, indent=1))
        (ctx.stage_dir / "shards.json").write_text(json.dumps(shards, indent=1))
        pq.write_table(pa.table(index_rows), ctx.stage_dir / "index.parquet")
        ctx.log(f"shard: {len(keys)} samples in {len(shards)} shards")
        return StageResult(ledger, {"shards": len(shards), "bytes": sum(s["bytes"] for s in shards)},
                           artifacts={"folder": "shard/shards", "shards": shards})


def _offsets(path: Path) -> list[tuple[str, int]]:
    out, seen = [], set()
    with tarfile.open(path) as tar:
        for m in tar:
            key = m.name.split(".", 1)[0]
            if key not in seen:
                seen.add(key)
                out.append((key, m.offset))
    return out


def _image_sizes(tar_paths) -> dict[tuple[str, str], int]:
    sizes = {}
    for t in tar_paths:
        with tarfile.open(t) as tar:
            for m in tar:
                if m.name.endswith(".jpg"):
                    sizes[(t, m.name[:-4])] = m.size
    return sizes


def _stage_notes(ctx: StageContext) -> dict[str, dict]:
    """Scores and details the earlier stages recorded for kept samples, for each sample's json."""
    notes: dict[str, dict] = {}
    for name, sdir in ctx.upstream.items():
        if name in ("source", "ingest", "tokenizer"):
            continue
        t = pq.read_table(sdir / "ledger.parquet", columns=["key", "verdict", "score", "detail"]).to_pylist()
        for r in t:
            if r["verdict"] == "kept" and (r["score"] is not None or r["detail"]):
                entry = notes.setdefault(r["key"], {})
                if r["score"] is not None:
                    entry[f"{name}_score"] = r["score"]
                if r["detail"]:
                    entry[f"{name}_detail"] = r["detail"]
    return notes
