"""`capline remove RUN --list FILE --reason TEXT`: take items out of a published dataset line.

A takedown request, a hash match against a safety list, a site that opted out after the crawl: the
items named in FILE leave the line, and never come back.

- FILE has one entry a line (`#` starts a comment): a URL, a sample key, the sha256 of the image
  bytes as downloaded, or the path of an image (relative to FILE's folder) whose re-encoded, resized
  or recompressed copies are removed too (dedup's within-data rule: the thumbnail descriptor
  within `--threshold` cosine, then the detail descriptor within `--detail-threshold`, so that a
  distinct picture that only looks alike, another shirt shot on white, stays). A
  prefix `url `, `key `, `sha256 ` or `image ` says which where it could be read otherwise.
- Matches are found in Ray tasks, one per input partition that may hold one: its published keys,
  its ingest ledger's URL and sha256, and (for image entries) dedup's descriptions of it. Without
  image entries the line's lookup (stages/shard/line_lookup.py) names those partitions in a read per
  run and bucket, so the cost grows with the matches, not the line; an image entry, or a line
  published before the lookup existed, checks every partition. No shard is read to find them.
- Only the shards that hold a match are rewritten (a task each, by the shard stage's own tar
  writer, so what stays keeps its bytes), as removal N of the line: the shard as it was is kept at
  `shard/line/versions/<N>/<name>` until the user deletes it; every other shard stays byte-identical.
  The line's record, the shard lists beside the tars (sizes.json, shardindex.json), the manifest,
  the dataset card and the MLflow data-build run name the removal: what, why, when, which shards.
- `shard/line/removed.parquet` holds every entry and every sample removed, with its descriptor:
  the dedup stage of every later run drops a sample that matches one (key, URL, sha256, or a near
  copy of a removed image), with reason `removed`, before anything is published.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from infra.errors import UserError
from stages.shard import line_lookup
from stages.shard.line import LINE, RECORD, published_all, published_file, published_parts, read_line
from stages.shard.removals import (DESCRIPTIONS, PENDING, PENDING_ROWS, REMOVED, framed_of, half_done,  # noqa: F401
                                   near_copies, near_copies_of, removal_digest)   # the line's removals, as dedup applies them

from infra.faults import killpoint

VERSIONS = f"{LINE}/versions"
KINDS = ("url", "key", "sha256", "image")
REMOVED_SCHEMA = pa.schema([("removal", pa.int32()), ("kind", pa.string()), ("value", pa.string()),
                            ("key", pa.string()), ("url", pa.string()), ("sha256", pa.string()),
                            ("vec", pa.binary()), ("threshold", pa.float64()), ("reason", pa.string()),
                            # the detail descriptor and its threshold (0: not checked); a file written
                            # before they were recorded reads them as missing
                            ("detail", pa.binary()), ("detail_threshold", pa.float64())])
KEY_LIKE = re.compile(r"u[0-9a-f]{16}")
SHA_LIKE = re.compile(r"[0-9a-fA-F]{64}")


@dataclass
class Entry:
    kind: str
    value: str
    line: int


MAX_IMAGE_BYTES = 64 << 20   # an image entry's file: a removal list's pictures are photos, not 3 GB sparse files


def parse_list(path: Path) -> list[Entry]:
    """The entries of a removal list; a line that is none of the kinds is a UserError naming it."""
    if not path.is_file():
        raise UserError(f"--list {path}: no such file")
    out = []
    for n, raw in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        # `#` starts a comment at a line's start or after a space: a URL's own fragment (`a.jpg#x`) stays
        text = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not text:
            continue
        head, _, rest = text.partition(" ")
        if head in KINDS and rest.strip():
            kind, value = head, rest.strip()
        elif re.match(r"^https?://", text, re.I):
            kind, value = "url", text
        elif KEY_LIKE.fullmatch(text):
            kind, value = "key", text
        elif SHA_LIKE.fullmatch(text):
            kind, value = "sha256", text.lower()
        elif (path.parent / text).is_file():
            kind, value = "image", text
        else:
            raise UserError(f"--list {path}:{n}: {text[:80]!r} is not a URL, a key (u + 16 hex digits), a sha256 "
                            "(64 hex digits) or an image file; prefix it with url, key, sha256 or image")
        if kind == "image" and not (path.parent / value).is_file():
            raise UserError(f"--list {path}:{n}: image {value} does not exist (paths are relative to the list's folder)")
        if kind == "image" and ((path.parent / value).is_symlink() or (path.parent / value).stat().st_size > MAX_IMAGE_BYTES):
            raise UserError(f"--list {path}:{n}: image {value} is a symbolic link or over {MAX_IMAGE_BYTES >> 20} MiB; "
                            "name the image file itself")
        out.append(Entry(kind, value, n))
    if not out:
        raise UserError(f"--list {path}: no entries (one URL, key, sha256 or image path a line)")
    return out


def removal_views(core: np.ndarray) -> list[np.ndarray]:
    """A removed picture as it may come back: itself, cropped up to 10 % (centred, corner-anchored,
    one side: imagehash.crops), mirrored, in grey, and turned by each whole degree up to 6 either way (black
    corners, as a rotated re-upload has them). Each is described and matched as a reference of its own."""
    from PIL import Image

    from stages.dedup.imagehash import crops

    im = Image.fromarray(core)
    turned = [np.asarray(im.rotate(a, resample=Image.BICUBIC)) for a in (-6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6)]
    grey = np.repeat(np.asarray(im.convert("L"))[..., None], 3, -1)
    return crops(core, scales=(0.05, 0.10)) + [core[:, ::-1], grey] + turned


def image_vectors(entries: list[Entry], base: Path) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(k, 768) thumbnail and (k, 576) detail descriptors of the image entries' views (`removal_views`),
    float32 unit rows (dedup's within-data descriptors, described as its describe step describes a
    picture), and which entry each row is a view of."""
    from stages.dedup.imagehash import DETAIL_DIM, describe, detail, to_rgb_array, trim_border

    vecs, details, owner = [], [], []
    for n, e in enumerate(entries):
        try:
            core = trim_border(to_rgb_array((base / e.value).read_bytes()))
            for view in removal_views(core):
                vecs.append(describe(view)[0])
                details.append(detail(view))
                owner.append(n)
        except Exception as err:  # noqa: BLE001 - an image we cannot read is the list's fault: said with its line
            raise UserError(f"--list line {e.line}: image {e.value} could not be read ({type(err).__name__}: {err})") from None
    if not vecs:
        return np.zeros((0, 768), np.float32), np.zeros((0, DETAIL_DIM), np.float32), []
    return np.stack(vecs), np.stack(details), owner


def _match_task(storage, part: str, ingest_file: str, desc_file: str | None, keys: frozenset, urls: frozenset,
                shas: frozenset, images: tuple[np.ndarray, np.ndarray, list], threshold: float,
                detail_threshold: float) -> list[dict]:
    """Ray task: the published samples of one input partition that an entry names: -> rows of (key,
    shard, how, url, sha256, vec, detail). Reads the partition's published keys, its ingest ledger's
    URL and sha256 columns, and its descriptions where image entries (`images`: their thumbnail and
    detail descriptors) were given or a sample matched."""
    vecs, details, _ = images
    pub = published_all(storage, part)
    if not pub.num_rows:
        return []
    led = storage.read_table(ingest_file, ["key", "url", "sha256"])
    led = led.filter(pc.is_in(led.column("key"), pub.column("key")))
    info = {k: (u, s) for k, u, s in zip(*(led.column(c).to_pylist() for c in ("key", "url", "sha256")))}
    def described(names) -> tuple[dict, dict, dict]:
        """key -> thumbnail and detail descriptors of `names` (a line described before the detail was
        has none: the thumbnail alone), and those inside a flat frame (`framed_of`)."""
        if not desc_file or not names:
            return {}, {}, {}
        d = storage.read_table(desc_file)
        d = d.filter(pc.is_in(d.column("key"), pa.array(sorted(names), pa.string())))
        keys = d.column("key").to_pylist()
        return (dict(zip(keys, d.column("vec").to_pylist())),
                dict(zip(keys, d.column("detail").to_pylist())) if "detail" in d.column_names else {}, framed_of(d))

    near, vec_of, detail_of = {}, None, None
    if len(vecs):
        vec_of, detail_of, framed = described(pub.column("key").to_pylist())
        names = list(vec_of)
        k = len(vecs)
        found = near_copies_of(names, vec_of, detail_of, framed, vecs, details, np.ones(k, bool),
                               np.full(k, threshold), np.full(k, detail_threshold)) if names else []
        near = {n: hit[1] for n, hit in zip(names, found) if hit is not None}
    out = []
    for key, shard in zip(pub.column("key").to_pylist(), pub.column("shard").to_pylist()):
        url, sha = info.get(key, (None, None))
        how = ("key" if key in keys else "url" if url in urls else "sha256" if sha in shas
               else f"image (cosine {near[key]:.3f})" if key in near else None)
        if how:
            out.append({"key": key, "shard": shard, "part": part, "how": how, "url": url, "sha256": sha})
    # every removed sample's descriptors are recorded, however it was named: a re-encoded copy of it
    # under a URL never seen is a near copy of a removed image to every later run's dedup
    if vec_of is None:      # no image entry read them: the matched samples' alone
        vec_of, detail_of, _ = described([m["key"] for m in out])
    for m in out:
        m.update(vec=vec_of.get(m["key"]), detail=detail_of.get(m["key"]))
    return out


def _rewrite_task(storage, name: str, removed: frozenset, old_copy: str):
    """Ray task: shard `name` without the removed samples, by the shard stage's tar writer (what
    stays keeps its bytes, order and headers); the shard as it was copied to `old_copy` first. Run
    again after a kill, it starts from that copy, never from its own half-finished result."""
    from infra.tars import tar_samples
    from stages.shard.stage import write_shard_table

    if storage.exists(old_copy):
        data = storage.read_bytes(old_copy)
    else:
        data = storage.read_bytes(f"shard/shards/{name}")
        storage.write_bytes(old_copy, data)          # the old version stays readable until pruned
    cols = {c: [] for c in ("key", "image", "ext", "caption", "meta")}
    gone = 0
    for key, parts in tar_samples(io.BytesIO(data), where=name):
        if key in removed:
            gone += 1
            continue
        ext = next(e for e in parts if e not in ("txt", "json"))
        for c, v in zip(cols, (key, parts[ext], ext, parts.get("txt", b"").decode("utf-8"),
                               parts.get("json", b"{}").decode("utf-8"))):
            cols[c].append(v)
    t = pa.table({"key": pa.array(cols["key"], pa.string()), "image": pa.array(cols["image"], pa.binary()),
                  "ext": pa.array(cols["ext"], pa.string()), "caption": pa.array(cols["caption"], pa.string()),
                  "meta": pa.array(cols["meta"], pa.string())})
    result = write_shard_table(storage, int(name[:6]), t)
    result.extra["removed"] = gone
    return result


def _unpublish_task(storage, part: str, removed: frozenset) -> int:
    """Ray task: the partition's published record without the removed keys."""
    t = published_all(storage, part)
    keep = t.filter(pc.invert(pc.is_in(t.column("key"), pa.array(sorted(removed), pa.string()))))
    storage.write_table(published_file(part), keep)
    return t.num_rows - keep.num_rows


def open_line(where: str, what: str):
    """A dataset line's run folder, local or in a bucket: -> (RunStore, Storage, manifest, line
    record); one-line errors when it is not a run folder or holds no line."""
    from .storage import RunStore

    store = RunStore(where)
    store.check()
    storage = store.storage()
    manifest = storage.read_json("manifest.json")
    if manifest is None:
        raise UserError(f"{where}: not a capline run folder (no manifest.json)")
    line = read_line(storage)
    if line is None:
        raise UserError(f"{where}: no dataset line here (shard/line/line.json); {what} a line a run with "
                        "stages.shard.append: true published")
    return store, storage, manifest, line


def remove(where: str, list_path: Path | None, reason: str | None, threshold: float | None, address: str | None,
           log=print, detail_threshold: float | None = None) -> dict | None:
    """Remove the list's items from the dataset line at `where`; -> the removal's record. An earlier
    removal that was interrupted is finished first; `list_path` None: only that (-> its record, or
    None when none was half done)."""
    from infra.ray_runtime import ray_session
    from infra.configtools import build

    from .config import RunConfig
    from .executor import Executor
    from .lock import run_lock
    from .trust import from_elsewhere

    if list_path is not None and not (reason or "").strip():
        raise UserError("--reason: say why these items are removed (it is recorded with them)")
    entries = parse_list(list_path) if list_path is not None else []
    store, storage, manifest, line = open_line(where, "`capline remove` takes items out of")
    cfg = from_elsewhere(build(RunConfig, manifest["config"]), f"{where}'s manifest", log=log, loads_code=False)
    threshold = threshold if threshold is not None else cfg.stages.dedup.within_threshold
    if not 0 < threshold <= 1:
        raise UserError(f"--threshold {threshold}: a cosine in (0, 1]")
    detail_threshold = (detail_threshold if detail_threshold is not None
                        else cfg.stages.dedup.within_detail_threshold)
    if not 0 <= detail_threshold <= 1:
        raise UserError(f"--detail-threshold {detail_threshold}: a cosine in [0, 1] (0: the thumbnail alone)")
    by_kind = {k: [e for e in entries if e.kind == k] for k in KINDS}
    # the lock for the whole removal, the list's decoding included: a line read before it was taken
    # is the line an append may have grown meanwhile, and writing it back dropped the append's shards
    with run_lock(store.local, log=log, uri=store.uri):
        store.pull(log=log)
        with ray_session(cfg.ray, address, log=log, trains=False):
            ex = Executor(log=log)
            pending = storage.read_json(PENDING)
            if pending is None and list_path is None:
                return None
            if pending is not None:
                # the journal is a file in the run folder: what it deletes runs only when this user's own
                # command asks, by --finish or by naming the same list and reason again
                again = list_path is not None and pending["list_sha256"] == _sha(list_path) and pending["reason"] == reason
                if list_path is not None and not again:
                    raise UserError(half_done(storage, where))
                log(f"remove: finishing removal {pending['removal']} (started {pending['at']}, "
                    f"{pending.get('reason')!r}): {len(pending['where'])} sample(s) from "
                    f"{len(set(pending['where'].values()))} shard(s)")
                return _finish(ex, storage, store, pending, log)
            line = read_line(storage)   # as the lock holder sees it
            images = image_vectors(by_kind["image"], list_path.parent)
            vecs = images[0]
            parts = {p["part"]: p["file"] for p in storage.read_json("ingest/parts.json") or []}
            published = sorted(published_parts(storage))
            desc = storage.read_json(DESCRIPTIONS) or {}
            if len(vecs) and not desc:
                raise UserError(f"{where}: this line's dedup stage did not record where its descriptions are "
                                f"({DESCRIPTIONS}); run `capline run` on it once, then remove by image")
            named = {k: [e.value for e in by_kind[k]] for k in line_lookup.KINDS}
            if not len(vecs) and line_lookup.complete(line.get("runs") or []):
                # the line's lookup: the partitions that hold a candidate, found in a few reads
                hits = ex.call(line_lookup.find, storage, line["runs"], named, what="remove: lookup", num_cpus=0.25)
                published = sorted(set(hits.column("part").to_pylist()) & set(published))
                log(f"remove: the line's lookup names {len(published)} partition(s) to check")
            found = ex.run(_match_task, [(storage, p, parts[p], desc.get(p), frozenset(named["key"]),
                                          frozenset(named["url"]), frozenset(named["sha256"]), images, threshold,
                                          detail_threshold)
                                         for p in published if p in parts],
                           "remove: find matches", num_cpus=0.5, unit="partitions")
            matches = sorted((m for got in found for m in got), key=lambda m: m["key"])
            listed = {s["name"] for s in line["shards"]}
            stray = sorted({m["shard"] for m in matches} - listed)
            if stray:
                raise UserError(f"the line's published records name shard(s) {', '.join(stray[:3])} that line.json does not "
                                "list; `capline verify` the line before removing from it")
            pending = _journal(storage, len(line.get("removals") or []) + 1, reason, entries, images, matches,
                               (threshold, detail_threshold), list_path)
            killpoint("remove: journalled")
            return _finish(ex, storage, store, pending, log)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _journal(storage, number: int, reason: str, entries: list[Entry], images: tuple, matches: list[dict],
             thresholds: tuple[float, float], list_path: Path) -> dict:
    """The removal decided, before anything is rewritten: its rows for removed.parquet, then what it
    takes from which shard and partition (written last: from here on it is finished, not redone)."""
    threshold, detail_threshold = thresholds
    rows = {c: [] for c in REMOVED_SCHEMA.names}

    def add(kind, value, key=None, url=None, sha=None, vec=None, det=None):
        for c, v in zip(rows, (number, kind, value, key, url, sha, vec, threshold, reason, det, detail_threshold)):
            rows[c].append(v)

    for e in entries:
        if e.kind != "image":
            add(e.kind, e.value)
    pictures = [e for e in entries if e.kind == "image"]
    for v, d, n in zip(*images):      # a row per view of each image entry
        add("image", pictures[n].value, vec=v.astype(np.float16).tobytes(), det=d.astype(np.float16).tobytes())
    for m in matches:
        add("sample", m["how"], m["key"], m["url"], m["sha256"], m["vec"], m.get("detail"))
    storage.write_table(PENDING_ROWS, pa.table(rows, schema=REMOVED_SCHEMA))
    pending = {"removal": number, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reason": reason,
               "list": list_path.name, "list_sha256": _sha(list_path),
               "entries": {k: sum(1 for e in entries if e.kind == k) for k in KINDS},
               "threshold": threshold, "detail_threshold": detail_threshold,
               "where": {m["key"]: m["shard"] for m in matches}, "parts": sorted({m["part"] for m in matches})}
    storage.write_json(PENDING, pending)
    return pending


def _finish(ex, storage, store, pending: dict, log) -> dict:
    """Carry out a journalled removal; every step can run again after a kill and gives the same
    files: a shard is rewritten from its kept old version once that exists, removed.parquet's rows of
    this removal and its line and manifest entries are replaced, not added again."""
    number, where = pending["removal"], pending["where"]
    listed = {s["name"] for s in (read_line(storage) or {}).get("shards") or []}
    if not set(where.values()) <= listed:    # a journal naming shards its line does not hold is not this line's
        raise UserError(f"{PENDING} names shard(s) {', '.join(sorted(set(where.values()) - listed)[:3])} that the "
                        "line does not list; it is not this line's journal: restore the line's own or delete it")
    removed = frozenset(where)
    rewritten = ex.run(_rewrite_task, [(storage, s, removed, f"{VERSIONS}/{number}/{s}") for s in sorted(set(where.values()))],
                       "remove: rewrite shards", num_cpus=1, unit="shards")
    killpoint("remove: shards rewritten")
    ex.run(_unpublish_task, [(storage, p, removed) for p in pending["parts"]],
           "remove: published records", num_cpus=0.25, unit="partitions", quiet=True)
    killpoint("remove: records unpublished")
    line = read_line(storage)
    record = _record(storage, line, pending, storage.read_table(PENDING_ROWS), rewritten)
    killpoint("remove: line written")
    _update_lists(storage, store, line, record)
    store.push_top()
    storage.delete_files([PENDING, PENDING_ROWS])
    return record


def _record(storage, line: dict, pending: dict, rows: pa.Table, rewritten: list) -> dict:
    """removed.parquet gains the removal's rows; line.json the removal and the rewritten shards (its
    last write: the removal is in force once the line lists it)."""
    number = pending["removal"]
    new = rows
    try:
        old = storage.read_table(REMOVED)
        for f in REMOVED_SCHEMA:       # a file from before a column was recorded: missing there
            if f.name not in old.column_names:
                old = old.append_column(f.name, pa.nulls(old.num_rows, f.type))
        old = old.filter(pc.not_equal(old.column("removal"), number))   # a finish after a kill wrote them once
        new = pa.concat_tables([old.select(REMOVED_SCHEMA.names).cast(REMOVED_SCHEMA), rows.cast(REMOVED_SCHEMA)])
    except (FileNotFoundError, OSError):
        pass
    storage.write_table(REMOVED, new)
    results = {r.extra["name"]: r for r in rewritten}
    shards = []
    for s in line["shards"]:
        r = results.get(s["name"])
        shards.append(s if r is None else {**{k: r.extra[k] for k in ("name", "samples", "bytes", "sha256", "md5")},
                                           "result": r.to_json()})
    keys = list(pending["where"])
    record = {**{k: pending[k] for k in ("removal", "at", "reason", "list", "list_sha256", "entries")},
              "removed": len(keys), "keys": keys[:1000],
              "where": dict(list(pending["where"].items())[:1000]),   # the shard each left (`capline explain`)
              "shards": sorted(results), "threshold": pending["threshold"],
              "detail_threshold": pending["detail_threshold"], "versions": f"{VERSIONS}/{number}"}
    removals = [r for r in line.get("removals") or [] if r.get("removal") != number] + [record]
    storage.write_json(RECORD, {**line, "shards": shards, "removals": removals})
    line.update(shards=shards, removals=removals)
    return record


def _update_lists(storage, store, line: dict, record: dict) -> None:
    """The shard lists users' readers take (sizes.json, shardindex.json, shards.json), the manifest's
    shard list (what `capline verify` checks), the card and the MLflow data-build run."""
    from .manifest import Manifest

    shards = line["shards"]
    listed = [{k: s[k] for k in ("name", "samples", "bytes", "sha256")} for s in shards]
    index = storage.read_json("shard/shards/shardindex.json") or {"__kind__": "wids-shard-index-v1", "wids_version": 1}
    index["shardlist"] = [{"url": s["name"], "nsamples": s["samples"], "filesize": s["bytes"], "md5sum": s["md5"]}
                          for s in shards]
    for rel, obj in (("shard/shards/sizes.json", {s["name"]: s["samples"] for s in listed}),
                     ("shard/shards/shardindex.json", index), ("shard/shards.json", listed)):
        storage.write_both(store.local, rel, json.dumps(obj, indent=1).encode())
    path = store.local / "manifest.json"
    m = Manifest(path, json.loads(path.read_text()) if path.is_file() else storage.read_json("manifest.json"))
    m.data["artifacts"].setdefault("shard", {})["shards"] = listed
    m.data["removals"] = [r for r in m.data.get("removals") or [] if r.get("removal") != record["removal"]] + \
        [{k: v for k, v in record.items() if k != "keys"}]
    m.save()       # pushed with the run's top files (RunStore.push_top)
    _card(storage, store, m)
    _mlflow(store, m, record)


def _card(storage, store, manifest) -> None:
    from infra.configtools import build

    from .config import RunConfig
    from .dataset_card import card
    from stages.registry import STAGES

    if "shard" not in manifest.data.get("stages", {}):
        return
    cfg = build(RunConfig, manifest.data["config"])
    names = [s.name for s in STAGES]
    summary = dict(zip(names, storage.read_jsons([f"{n}/stats.json" for n in names])))   # at once, not in turn
    text = card(manifest.data, {k: v for k, v in summary.items() if v}, cfg)
    storage.write_both(store.local, "shard/README.md", text.encode())


def _mlflow(store, manifest, record: dict, log=print) -> None:
    run_id = manifest.data.get("mlflow_runs", {}).get("data")
    if not run_id:
        return
    from infra.tracking import client, redact, tracking_uri

    uri = tracking_uri(store.local)
    try:
        from mlflow.entities import Metric

        c = client(uri)
        now = int(time.time() * 1000)
        c.set_tag(run_id, f"capline.removal.{record['removal']}",
                  f"{record['removed']} samples, shards {', '.join(record['shards']) or 'none'}: {record['reason']}"[:500])
        c.log_batch(run_id, metrics=[Metric("removed_samples", sum(r["removed"] for r in manifest.data["removals"]),
                                            now, record["removal"])])
    except Exception as err:  # noqa: BLE001 - tracking is not the data
        log(f"mlflow: could not record the removal on the data-build run at {redact(uri)} ({type(err).__name__})")


RECHECKS = f"{LINE}/rechecks"


def _host_pieces(storage, part: str, ingest_file: str, buckets: int) -> list[list[str]]:
    """Ray task (the recheck shuffle's map): a partition's published URLs, cut by host into `buckets`."""
    import urllib.parse

    from stages.dataplane import hash_buckets

    pub = published_all(storage, part)
    led = storage.read_table(ingest_file, ["key", "url"])
    urls = [u for u in led.filter(pc.is_in(led.column("key"), pub.column("key"))).column("url").to_pylist() if u]
    b = hash_buckets([urllib.parse.urlsplit(u).netloc for u in urls], buckets)
    out = [[] for _ in range(buckets)]
    for u, i in zip(urls, b):
        out[int(i)].append(u)
    return out


@dataclass(frozen=True)
class Rechecked:
    """What one recheck task found of its hosts' URLs."""
    opted_out: dict          # URL -> why (robots_disallowed...): the URLs that opt out now
    unreachable: int
    hosts: dict              # host -> {"checked", "opted_out", "unreachable"}


def _recheck_reduce(policy, token: str, directives: tuple, timeout: float, progress, *pieces: list[str]) -> Rechecked:
    """Ray task (the recheck shuffle's reduce): every URL of its hosts asked again (stages/ingest/fetch.py:
    recheck), each counted to `progress` as it is answered: -> the URLs that opt out now, with why,
    and counts per host."""
    import urllib.parse

    from stages.ingest.fetch import recheck

    urls = sorted({u for p in pieces for u in p})
    got = recheck(urls, policy, token, directives, timeout, progress=progress)
    hosts: dict[str, dict[str, int]] = {}
    for u, why in got.items():
        h = hosts.setdefault(urllib.parse.urlsplit(u).netloc, {"checked": 0, "opted_out": 0, "unreachable": 0})
        h["checked"] += 1
        if why.startswith("robots_disallowed"):
            h["opted_out"] += 1
        elif why:
            h["unreachable"] += 1
    return Rechecked({u: why for u, why in got.items() if why.startswith("robots_disallowed")},
                     sum(1 for why in got.values() if why.startswith("unreachable")), hosts)


def recheck_line(where: str, address: str | None, log=print) -> dict:
    """Ask every URL a dataset line published whether it still may be used (robots.txt and
    X-Robots-Tag, politely, hosts in parallel); remove those that opted out since, as a removal whose
    reason says so. -> the report (also in shard/line/rechecks/<n>.json)."""
    import tempfile

    from infra.configtools import build
    from infra.ray_runtime import ray_session
    from stages.ingest.stage import HEADER_DIRECTIVES, fetch_policy

    from .config import RunConfig
    from .executor import Executor
    from .trust import from_elsewhere

    store, storage, manifest, _ = open_line(where, "`capline recheck` asks again the URLs of")
    cfg = from_elsewhere(build(RunConfig, manifest["config"]), f"{where}'s manifest", log=log, loads_code=False)
    ing = cfg.stages.ingest
    parts = {p["part"]: p["file"] for p in storage.read_json("ingest/parts.json") or []}
    # one Ray session for the HEADs and the removal (remove() finds Ray up and uses it)
    if (stop := half_done(storage, where)) is not None:   # an interrupted removal (a recheck's own, killed)
        raise UserError(stop)
    with ray_session(cfg.ray, address, log=log, trains=False):
        ex = Executor(log=log)
        buckets = max(1, int(ex.shape().cpus))
        # a host's URLs all in one task: its rate and concurrency hold whole there, hosts in parallel
        policy = fetch_policy(ing, tuple(ing.allow_hosts), at_once=1)
        published = sorted(published_parts(storage))
        # progress in URLs: a line's samples (sizes.json), each one URL
        total = sum((storage.read_json("shard/shards/sizes.json") or {}).values())
        got = ex.shuffle(_host_pieces, [(storage, p, parts[p], buckets) for p in published if p in parts], buckets,
                         _recheck_reduce, [(policy, ing.user_agent_token, HEADER_DIRECTIVES, ing.timeout)] * buckets,
                         "recheck: robots.txt and headers", num_cpus=1, items=total, item_unit="URLs")
        opted = dict(sorted((u, why) for g in got for u, why in g.opted_out.items()))
        hosts = {h: c for g in got for h, c in g.hosts.items()}
        number = len(storage.list(RECHECKS, ".json")) + 1
        report = {"recheck": number, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "checked": sum(c["checked"] for c in hosts.values()), "opted_out": len(opted),
                  "unreachable": sum(g.unreachable for g in got), "hosts": dict(sorted(hosts.items())),
                  "urls": opted, "removal": None}
        if opted:
            with tempfile.TemporaryDirectory(prefix="capline-recheck-") as tmp:
                listed = Path(tmp) / f"recheck-{number}.txt"
                listed.write_text("".join(f"url {u}\n" for u in opted))
                removal = remove(where, listed, f"opted out since publication (capline recheck {number}: robots.txt "
                                                "or X-Robots-Tag)", None, address, log=log)
            report["removal"] = removal["removal"]
            report["removed"] = removal["removed"]
    storage.write_json(f"{RECHECKS}/{number:04d}.json", report)
    return report
