"""`capline verify` and `capline rebuild`'s drift report.

verify RUN_DIR: every final shard against the checksums in manifest.json (and sizes.json against
the tar contents). verify RUN_DIR OTHER: byte-identical, or which samples differ and how.
"""
from __future__ import annotations

import hashlib
import json
import math
import tarfile
from dataclasses import dataclass
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
    from infra.storage import Storage
    from stages.shard.removals import half_done

    manifest = _manifest(run_dir)
    shards = _shard_list(run_dir, manifest)
    folder = run_dir / "shard" / "shards"
    # what a kill left half done comes first: the checksums below then say what it touched
    problems = [p for p in [half_done(Storage.of(str(run_dir)), str(run_dir))] if p]
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


DRIFT_LISTED = 1000            # URLs of each kind drift.json lists (all of them: the Parquet files in drift/)
DRIFT_ROWS_PER_BUCKET = 2_000_000
DRIFT_KINDS = ("died", "changed", "revived")


def _ingest_files(storage) -> list[str]:
    parts = storage.read_json("ingest/parts.json")
    if parts is None:
        raise UserError(f"{storage.uri()}: no ingest ledger to compare downloads with")
    return [p["file"] for p in parts]


def _drift_pieces(storage, file: str, buckets: int) -> list[pa.Table]:
    """Ray task (the drift shuffle's map): one ingest partition's (key, verdict, sha256, url), cut by
    key into `buckets` pieces for the compare tasks (through Ray's object store, not the bucket)."""
    from stages.dataplane import hash_pieces

    t = storage.read_table(file, ["key", "verdict", "sha256", "url"])
    return hash_pieces(t, t.column("key").to_pylist(), buckets)


@dataclass(frozen=True)
class Drifted:
    """One drift bucket's URLs (in drift/<bucket>.parquet), as counts and the first few of each kind."""
    counts: dict            # died / changed / revived -> how many
    first: dict             # died / changed / revived -> the first DRIFT_LISTED URLs


def _drift_reduce(storage, bucket: int, n_old: int, *pieces: pa.Table) -> Drifted:
    """Ray task (the drift shuffle's reduce): one key bucket of both runs (the original's pieces
    first) -> its died / changed / revived URLs, written to drift/<bucket>.parquet; -> counts and
    the first DRIFT_LISTED URLs of each kind."""
    def load(tables):
        out = {}
        for t in tables:
            for k, v, h, u in zip(*(t.column(c).to_pylist() for c in ("key", "verdict", "sha256", "url"))):
                out[k] = ("success" if v == "kept" else "failed", h, u)
        return out

    old, new = load(pieces[:n_old]), load(pieces[n_old:])
    found = {
        "died": sorted(k for k, (s, _, _) in old.items() if s == "success" and new.get(k, ("missing",))[0] != "success"),
        "changed": sorted(k for k, (s, h, _) in old.items()
                          if s == "success" and new.get(k, ("",))[0] == "success" and new[k][1] != h),
        "revived": sorted(k for k, (s, _, _) in old.items() if s != "success" and new.get(k, ("",))[0] == "success")}
    rows = sorted((old[k][2] or "", k, kind) for kind, keys in found.items() for k in keys)
    storage.write_table(f"drift/{bucket:06d}.parquet",
                        pa.table({"url": [r[0] for r in rows], "key": [r[1] for r in rows], "drift": [r[2] for r in rows]},
                                 schema=pa.schema([("url", pa.string()), ("key", pa.string()), ("drift", pa.string())])))
    return Drifted({kind: len(keys) for kind, keys in found.items()},
                   {kind: sorted(old[k][2] or k for k in keys)[:DRIFT_LISTED] for kind, keys in found.items()})


def drift(old_run, new_run, executor) -> dict:
    """URLs that died, URLs whose content changed and URLs that came back between two runs'
    downloads: both ingest ledgers cut by key in Ray tasks and handed through Ray's object store to
    a task per key bucket, which compares them and writes its URLs to the new run's drift/
    (Parquet); the driver gets counts and the first DRIFT_LISTED URLs of each kind, never every one."""
    import heapq

    from infra.storage import Storage

    old_s, new_s = Storage.of(old_run), Storage.of(new_run)
    old_files, new_files = _ingest_files(old_s), _ingest_files(new_s)
    rows = sum(p.get("in", 0) for p in old_s.read_json("ingest/parts.json") + new_s.read_json("ingest/parts.json"))
    buckets = max(1, math.ceil(rows / DRIFT_ROWS_PER_BUCKET), min(int(executor.shape().cpus), rows // 1000))
    new_s.delete("drift")
    maps = [(old_s, f, buckets) for f in old_files] + [(new_s, f, buckets) for f in new_files]
    got = executor.shuffle(_drift_pieces, maps, buckets, _drift_reduce,
                           [(new_s, b, len(old_files)) for b in range(buckets)], "drift: compare", num_cpus=0.5)
    out = {"counts": {k: sum(g.counts[k] for g in got) for k in DRIFT_KINDS},
           "listed": DRIFT_LISTED, "all": new_s.uri("drift")}
    for kind in DRIFT_KINDS:
        out[kind] = list(heapq.merge(*(g.first[kind] for g in got)))[:DRIFT_LISTED]
    return out


SAMPLES_PER_BUCKET = 2_000_000
COMPARE_LISTED = 50            # samples of each kind a comparison names


def _shard_names(storage) -> list[dict]:
    return storage.read_json("shard/shards.json") or []


def _sample_pieces(storage, rel: str, buckets: int) -> list[pa.Table]:
    """Ray task (the sample comparison's map): one shard's samples as (key, members), where members
    says each member's extension and sha256, cut by key into `buckets` pieces."""
    from infra.tars import tar_samples
    from stages.dataplane import hash_pieces

    keys, members = [], []
    for key, parts in tar_samples(storage.uri(rel), where=rel):
        keys.append(key)
        members.append(",".join(f"{ext}={hashlib.sha256(data).hexdigest()}" for ext, data in sorted(parts.items())))
    t = pa.table({"key": pa.array(keys, pa.string()), "members": pa.array(members, pa.string())})
    return hash_pieces(t, keys, buckets)


@dataclass(frozen=True)
class Compared:
    """One key bucket of two runs' shards, compared sample by sample."""
    samples: int            # in the original
    rebuilt: int            # in the rebuild
    only_in_original: int
    only_in_rebuild: int
    changed: int
    first: list             # the first COMPARE_LISTED differences of each kind, said in a line each


def _sample_reduce(n_old: int, *pieces: pa.Table) -> Compared:
    """Ray task (the sample comparison's reduce): one key bucket of both runs' shards (the
    original's pieces first) -> counts and the first COMPARE_LISTED keys of each kind of difference."""
    def load(tables):
        return {k: m for t in tables for k, m in zip(t.column("key").to_pylist(), t.column("members").to_pylist())}

    old, new = load(pieces[:n_old]), load(pieces[n_old:])
    changed = []
    for k in sorted(set(old) & set(new)):
        if old[k] != new[k]:
            a, b = (dict(p.split("=", 1) for p in m.split(",") if p) for m in (old[k], new[k]))
            changed.append(f"{k}: {', '.join(sorted(e for e in set(a) | set(b) if a.get(e) != b.get(e)))} differ")
    only_old, only_new = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    return Compared(len(old), len(new), len(only_old), len(only_new), len(changed),
                    sorted([f"{k}: only in the original" for k in only_old[:COMPARE_LISTED]]
                           + [f"{k}: only in the rebuild" for k in only_new[:COMPARE_LISTED]] + changed[:COMPARE_LISTED]))


def compare_samples(old_run, new_run, executor) -> dict:
    """Two runs' published shards, sample by sample: the same keys with the same member bytes,
    whatever shards they sit in (a dataset line publishes its appends in shards of their own, a
    rebuild of the whole line lays the same samples out afresh). Each shard is read once in a Ray
    task; its (key, digests) go through Ray's object store to a task per key bucket. -> counts and
    the first differences; `identical` when no sample differs."""
    from infra.storage import Storage

    old_s, new_s = Storage.of(old_run), Storage.of(new_run)
    old_shards, new_shards = _shard_names(old_s), _shard_names(new_s)
    total = sum(s.get("samples", 0) for s in old_shards + new_shards)
    buckets = max(1, math.ceil(total / SAMPLES_PER_BUCKET), min(int(executor.shape().cpus), total // 2000))
    maps = ([(old_s, f"shard/shards/{s['name']}", buckets) for s in old_shards]
            + [(new_s, f"shard/shards/{s['name']}", buckets) for s in new_shards])
    got = executor.shuffle(_sample_pieces, maps, buckets, _sample_reduce, [(len(old_shards),)] * buckets,
                           "shards: compare sample by sample", num_cpus=0.5)
    out = {k: sum(getattr(g, k) for g in got) for k in ("samples", "rebuilt", "only_in_original", "only_in_rebuild", "changed")}
    out["identical"] = not (out["only_in_original"] or out["only_in_rebuild"] or out["changed"])
    out["first"] = sorted(line for g in got for line in g.first)[:COMPARE_LISTED]
    return out
