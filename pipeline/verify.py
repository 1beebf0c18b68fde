"""`capline verify` and `capline rebuild`'s drift report.

verify RUN_DIR: every final shard against the checksums in manifest.json (and sizes.json against
the tar contents). verify RUN_DIR OTHER: byte-identical, or which samples differ and how.
"""
from __future__ import annotations

import hashlib
import json
import math
import tarfile
from pathlib import Path

import pyarrow as pa


from infra.hashing import hash_file as sha256_file
from infra.errors import UserError


def _manifest(run_dir: Path) -> dict:
    path = run_dir / "manifest.json"
    if not path.is_file():
        raise UserError(f"{run_dir}: not a capline run folder (no manifest.json)")
    return json.loads(path.read_text())


def _shard_list(run_dir: Path, manifest: dict) -> list[dict]:
    shards = manifest.get("artifacts", {}).get("shard", {}).get("shards")
    if shards is None:
        raise UserError(f"{run_dir}: the shard stage has not finished; nothing to verify")
    return shards


def verify_run(run_dir: Path) -> tuple[list[str], int]:
    """-> (problems, shards checked)."""
    manifest = _manifest(run_dir)
    shards = _shard_list(run_dir, manifest)
    folder = run_dir / "shard" / "shards"
    problems = []
    sizes_path = folder / "sizes.json"
    sizes = json.loads(sizes_path.read_text()) if sizes_path.is_file() else {}
    digests = _hash_all([folder / s["name"] for s in shards])
    for s in shards:
        path = folder / s["name"]
        if not path.is_file():
            problems.append(f"shard {s['name']}: missing")
            continue
        if path.stat().st_size != s["bytes"] or digests[path] != s["sha256"]:
            problems.append(f"shard {s['name']}: checksum differs from manifest.json "
                            f"({path.stat().st_size} bytes, expected {s['bytes']}): modified or truncated")
            continue
        if sizes.get(s["name"]) != s["samples"]:
            problems.append(f"shard {s['name']}: sizes.json says {sizes.get(s['name'])} samples, manifest {s['samples']}")
    tok = manifest.get("artifacts", {}).get("tokenizer")
    if tok:
        model = run_dir / tok["model"]
        if not model.is_file() or sha256_file(model) != tok["sha256"]:
            problems.append(f"tokenizer {tok['model']}: missing or checksum differs from manifest.json")
    return problems, len(shards)


def _hash_all(paths: list[Path]) -> dict[Path, str | None]:
    """sha256 of each file that exists, several at once (hashlib lets go of the GIL on large reads)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1))) as pool:
        return dict(zip(paths, pool.map(lambda p: sha256_file(p) if p.is_file() else None, paths)))


def sample_digests(run_dir: Path) -> dict[str, dict[str, str]]:
    """key -> {member extension: sha256} over every final shard."""
    from infra.tars import tar_samples

    out: dict[str, dict[str, str]] = {}
    for path in sorted((run_dir / "shard" / "shards").glob("*.tar")):
        for key, parts in tar_samples(path):
            for ext, data in parts.items():
                out.setdefault(key, {})[ext] = hashlib.sha256(data).hexdigest()
    return out


MAX_JSON_DIFFS = 200


def sample_jsons(run_dir: Path, keys: set) -> dict[str, dict]:
    """key -> the sample's json, for `keys` only."""
    import json

    from infra.tars import tar_samples

    out = {}
    if not keys:
        return out
    for path in sorted((run_dir / "shard" / "shards").glob("*.tar")):
        for key, parts in tar_samples(path):
            if key in keys and "json" in parts:
                try:
                    out[key] = json.loads(parts["json"])
                except ValueError:
                    out[key] = {"(not JSON)": parts["json"][:80].decode("utf-8", "replace")}
    return out


def file_digests(run_dir: Path) -> dict[str, str]:
    """shard name -> sha256 of the file on disk now (not what a manifest says it was)."""
    _shard_list(run_dir, _manifest(run_dir))   # a run whose shard stage finished
    return {p.name: h for p, h in _hash_all(sorted((run_dir / "shard" / "shards").glob("*.tar"))).items()}


def compare_runs(a: Path, b: Path) -> list[str]:
    """[] when the two runs' shard files are byte-identical, read from disk; else lines naming what
    differs (a file that does not parse as a tar is named, not compared member by member)."""
    fa, fb = file_digests(a), file_digests(b)
    if fa == fb and fa:
        return []
    unreadable = []
    for run, files in ((a, fa), (b, fb)):
        for name in files:
            try:
                with tarfile.open(run / "shard" / "shards" / name) as tar:
                    for _ in tar:
                        pass
            except (tarfile.TarError, OSError, EOFError) as err:
                unreadable.append(f"{run}/shard/shards/{name}: not a readable tar ({type(err).__name__}: {err})")
    if unreadable:
        return unreadable + [f"shard {n}: sha256 differs" for n in sorted(set(fa) & set(fb)) if fa[n] != fb[n]]
    da, db = sample_digests(a), sample_digests(b)
    lines = []
    for key in sorted(set(da) - set(db)):
        lines.append(f"{key}: only in {a}")
    for key in sorted(set(db) - set(da)):
        lines.append(f"{key}: only in {b}")
    changed = {}
    for key in sorted(set(da) & set(db)):
        if da[key] != db[key]:
            changed[key] = sorted(ext for ext in set(da[key]) | set(db[key]) if da[key].get(ext) != db[key].get(ext))
    # a differing json: which of its fields, and their two values (read again, only these samples)
    wanted = {k for k, exts in list(changed.items())[:MAX_JSON_DIFFS] if "json" in exts}
    ja, jb = sample_jsons(a, wanted), sample_jsons(b, wanted)
    for key, exts in changed.items():
        fields = ""
        if key in ja and key in jb:
            names = sorted(f for f in set(ja[key]) | set(jb[key]) if ja[key].get(f) != jb[key].get(f))
            fields = " (json: " + "; ".join(f"{f} {ja[key].get(f)!r} -> {jb[key].get(f)!r}"[:160] for f in names) + ")"
        lines.append(f"{key}: {', '.join(exts)} differ{fields}")
    if not lines:
        lines.append("the same samples with the same bytes, but laid out in different shards")
    return lines


DRIFT_LISTED = 1000            # keys of each kind drift.json lists (all of them: the Parquet files in drift/)
DRIFT_ROWS_PER_BUCKET = 2_000_000
DRIFT_SCHEMA = pa.schema([("key", pa.string()), ("verdict", pa.string()), ("sha256", pa.string()),
                          ("bucket", pa.int32())])


def _ingest_files(storage) -> list[str]:
    parts = storage.read_json("ingest/parts.json")
    if parts is None:
        raise UserError(f"{storage.uri()}: no ingest ledger to compare downloads with")
    return [p["file"] for p in parts]


def _drift_map(src, file: str, dst, rel: str, buckets: int) -> int:
    """Ray task: one ingest partition's (key, verdict, sha256), bucketed by key, into one file."""
    from infra.shuffle import write_buckets
    from stages.dataplane import hash_buckets

    t = src.read_table(file, ["key", "verdict", "sha256"])
    write_buckets(dst, rel, t.append_column("bucket", pa.array(hash_buckets(t.column("key").to_pylist(), buckets))),
                  "bucket")
    return t.num_rows


def _drift_reduce(storage, bucket: int, old_files: list[str], new_files: list[str]) -> dict:
    """Ray task: one key bucket of both runs -> its died / changed / revived keys, written to
    drift/<bucket>.parquet; -> counts and the first DRIFT_LISTED keys of each kind."""
    from infra.shuffle import read_bucket

    def load(files):
        t = read_bucket(storage, files, "bucket", bucket, DRIFT_SCHEMA)
        return {k: ("success" if v == "kept" else "failed", h)
                for k, v, h in zip(*(t.column(c).to_pylist() for c in ("key", "verdict", "sha256")))}

    old, new = load(old_files), load(new_files)
    found = {
        "died": sorted(k for k, (s, _) in old.items() if s == "success" and new.get(k, ("missing", None))[0] != "success"),
        "changed": sorted(k for k, (s, h) in old.items()
                          if s == "success" and new.get(k, ("", None))[0] == "success" and new[k][1] != h),
        "revived": sorted(k for k, (s, _) in old.items() if s != "success" and new.get(k, ("", None))[0] == "success")}
    rows = sorted((k, kind) for kind, keys in found.items() for k in keys)
    storage.write_table(f"drift/{bucket:06d}.parquet", pa.table({"key": [r[0] for r in rows], "drift": [r[1] for r in rows]},
                                                              schema=pa.schema([("key", pa.string()), ("drift", pa.string())])))
    return {kind: {"count": len(keys), "first": keys[:DRIFT_LISTED]} for kind, keys in found.items()}


def drift(old_run, new_run, executor) -> dict:
    """URLs that died, URLs whose content changed and URLs that came back between two runs'
    downloads: both ingest ledgers bucketed by key in Ray tasks, a task per bucket compares them and
    writes its keys to the new run's drift/ (Parquet); the driver gets counts and the first
    DRIFT_LISTED keys of each kind, never every key."""
    import heapq

    from infra.storage import Storage

    old_s, new_s = Storage.of(old_run), Storage.of(new_run)
    old_files, new_files = _ingest_files(old_s), _ingest_files(new_s)
    rows = sum(p.get("in", 0) for p in old_s.read_json("ingest/parts.json") + new_s.read_json("ingest/parts.json"))
    buckets = max(1, math.ceil(rows / DRIFT_ROWS_PER_BUCKET), min(int(executor.shape().cpus), rows // 1000))
    new_s.delete("drift")
    maps = [(src, f, new_s, f"drift/_work/{side}/{i:06d}.parquet", buckets)
            for side, src, files in (("old", old_s, old_files), ("new", new_s, new_files)) for i, f in enumerate(files)]
    executor.run(_drift_map, maps, "drift: ledgers by key", num_cpus=0.5, quiet=True)
    got = executor.run(_drift_reduce, [(new_s, b, [m[3] for m in maps if "/old/" in m[3]],
                                        [m[3] for m in maps if "/new/" in m[3]]) for b in range(buckets)],
                       "drift: compare", num_cpus=0.5, unit="buckets")
    new_s.delete("drift/_work")
    out = {"counts": {k: sum(g[k]["count"] for g in got) for k in ("died", "changed", "revived")},
           "listed": DRIFT_LISTED, "all": new_s.uri("drift")}
    for kind in ("died", "changed", "revived"):
        out[kind] = list(heapq.merge(*(g[kind]["first"] for g in got)))[:DRIFT_LISTED]
    return out
