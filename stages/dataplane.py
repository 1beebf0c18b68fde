"""The data plane: every stage's per-sample results as partitioned Parquet, written by the workers.

A stage's output is `<stage>/ledger/<part>.parquet`, one file per partition, each written by the Ray
task that computed it, through the run folder's filesystem (`Storage`: a pyarrow.fs filesystem and a
root, so a local folder and a bucket are the same code). Every row is one sample that entered the
stage, in one schema (`SAMPLE_SCHEMA`): the ledger columns (key, stage, verdict, reason, score,
detail, and what a match refers to: match_set, match_key; a reason is one of the stage's declared
reasons, never a string with data in it) and the sample's current state that later stages read (url, caption, and, from ingest on,
the sample index: tar, member, offset, size, sha256 and the original width and height).

The driver never sees rows. A task returns a `PartResult`: counts per verdict and reason, and an
order-independent checksum of its key sets (the sum mod 2^64 of a 64-bit hash of each key) over what
it read and over what it wrote. `check_parts` proves in = kept + dropped per partition and that the
partitions together took exactly the previous stage's kept samples, naming the partition that lost
or gained one. Driver memory grows with the number of partitions only.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from infra.remote import Stored
from infra.storage import Storage  # noqa: F401 - the run folder's filesystem, shared with trainers/

from .picks import pick_rows

KEPT, DROPPED = "kept", "dropped"
LEDGER_COLUMNS = ("key", "stage", "verdict", "reason", "score", "detail", "match_set", "match_key")
SAMPLE_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("stage", pa.string()),
    ("verdict", pa.string()),
    ("reason", pa.string()),
    ("score", pa.float64()),
    ("detail", pa.string()),         # for a person: what the reason means for this sample
    ("match_set", pa.string()),      # a match's reference set (the evaluation set an eval_duplicate matched)
    ("match_key", pa.string()),      # the matched sample: the duplicate kept, the evaluation item
    # the sample as later stages see it
    ("partition", pa.string()),     # the source partition (URL list file) it came from
    ("url", pa.string()),
    ("caption", pa.string()),       # the current caption (cleaned once the basic stage ran)
    ("notes", pa.string()),         # JSON: scores and details earlier stages recorded for it
    # the sample index, from ingest on
    ("tar", pa.string()),           # run-folder-relative path of the ingest tar holding the image
    ("member", pa.string()),        # the image's member name in that tar
    ("offset", pa.int64()),         # byte offset of the member's data in the tar
    ("size", pa.int64()),           # bytes of the image as stored
    ("sha256", pa.string()),        # of the bytes as downloaded
    ("width", pa.int64()),          # original size, before ingest resized it
    ("height", pa.int64()),
])
CARRIED = [f.name for f in SAMPLE_SCHEMA if f.name not in LEDGER_COLUMNS]
MASK = (1 << 64) - 1


# -- key-set checksums ---------------------------------------------------------------------------
def key_hashes(keys) -> np.ndarray:
    """64-bit hash of each key (blake2b), as uint64."""
    raw = b"".join(hashlib.blake2b(str(k).encode(), digest_size=8).digest() for k in keys)
    return np.frombuffer(raw, dtype="<u8")


def hash_buckets(values, n: int) -> np.ndarray:
    """Each value's bucket of `n` by its 64-bit hash (int32): the one way keys, pairs and partition
    names are spread over a shuffle's buckets."""
    return (key_hashes(values) % np.uint64(n)).astype(np.int32) if len(values) else np.zeros(0, np.int32)


def hash_pieces(table: pa.Table, values, n: int) -> list[pa.Table]:
    """`table` cut into `n` pieces by each row's `hash_buckets` of `values` (a shuffle's map output)."""
    return bucket_pieces(table, hash_buckets(values, n), n)


def bucket_pieces(table: pa.Table, buckets: np.ndarray, n: int) -> list[pa.Table]:
    """`table` cut into `n` pieces by each row's bucket (0..n-1), rows keeping their order within a
    piece: one stable sort and n slices, not n filters."""
    order = np.argsort(buckets, kind="stable")
    ends = np.searchsorted(buckets[order], np.arange(n + 1))
    ordered = table.take(pa.array(order)) if len(order) else table
    return [ordered.slice(int(ends[b]), int(ends[b + 1] - ends[b])) for b in range(n)]


def keyset_sum(keys) -> int:
    """Order-independent checksum of a set of keys: the sum mod 2^64 of their hashes."""
    h = key_hashes(keys)
    return int(h.sum(dtype=np.uint64)) if len(h) else 0   # numpy's uint64 sum wraps mod 2^64


def add_sums(*sums: int | str) -> int:
    return sum(int(s) for s in sums) & MASK


# -- the run folder's storage --------------------------------------------------------------------
# -- one partition's result ----------------------------------------------------------------------
def part_file(stage: str, part: str) -> str:
    return f"{stage}/ledger/{part}.parquet"


@dataclass
class PartResult:
    """What a task returns for the partition it wrote: counts and key-set checksums, never rows.
    In `parts.json` as JSON, with `n_in` named `in` (the file's format is unchanged)."""
    part: str
    file: str
    input: str | None            # the upstream partition it read (None: the stage re-partitioned)
    sha256: str                  # of the partition file as written
    bytes: int
    n_in: int                    # samples that entered it
    in_sum: str                  # their key-set checksum (decimal text: JSON has no uint64)
    kept: int
    kept_sum: str
    dropped: dict[str, int]      # per reason
    dropped_sum: str
    extra: dict = field(default_factory=dict)   # the stage's own per-partition figures
    # the ledger's keys, for the stage's key index: never in parts.json; through the object store
    # from the task that wrote them (pipeline/task_results.Stored), let go once the index is built
    stored: Stored | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "stored"}
        out["in"] = out.pop("n_in")
        return out

    @classmethod
    def from_json(cls, data: dict) -> "PartResult":
        data = dict(data)
        data["n_in"] = data.pop("in")
        return cls(**data)


def parts_from_json(rows: list[dict] | None) -> list[PartResult] | None:
    return None if rows is None else [PartResult.from_json(r) for r in rows]


def summarize(stage: str, part: str, input_name: str | None, in_keys, out: pa.Table, sha: str, nbytes: int,
              extra: dict | None = None) -> PartResult:
    """The PartResult of a partition as written."""
    verdicts = out.column("verdict")
    kept_mask = pc.equal(verdicts, KEPT)
    kept_keys = out.column("key").filter(kept_mask).to_pylist()
    dropped = out.filter(pc.invert(kept_mask))
    reasons = Counter(dropped.column("reason").to_pylist())
    return PartResult(part=part, file=part_file(stage, part), input=input_name, sha256=sha, bytes=nbytes,
                      n_in=len(in_keys), in_sum=str(keyset_sum(in_keys)),
                      kept=len(kept_keys), kept_sum=str(keyset_sum(kept_keys)),
                      dropped=dict(sorted(reasons.items())),
                      dropped_sum=str(keyset_sum(dropped.column("key").to_pylist())), extra=extra or {})


def check_parts(stage: str, parts: list[PartResult], upstream: list[PartResult] | None) -> dict:
    """in = kept + dropped per partition, and the partitions took exactly upstream's kept samples.

    A partition whose verdicts do not match what it read, or an upstream partition whose kept
    samples did not all arrive, fails the stage with that partition named. -> the stage's counts.
    """
    for p in parts:
        n_out = p.kept + sum(p.dropped.values())
        if n_out != p.n_in or add_sums(p.kept_sum, p.dropped_sum) != int(p.in_sum):
            raise RuntimeError(
                f"stage {stage}, partition {p.part}: {p.n_in} samples entered and {n_out} got a verdict, "
                f"and the key-set checksums differ: a sample was lost or added")
    if upstream is not None:
        if all(p.input for p in parts):
            came: dict[str, list] = {}
            for p in parts:
                came.setdefault(p.input, []).append(p)
            known = {u.part for u in upstream}
            for name in sorted(set(came) - known):
                raise RuntimeError(f"stage {stage}: partition(s) read {name}, which the previous stage never wrote")
            for u in upstream:
                got = came.get(u.part, [])
                n, s = sum(p.n_in for p in got), add_sums(*(p.in_sum for p in got))
                if n != u.kept or s != int(u.kept_sum):
                    raise RuntimeError(
                        f"stage {stage}: upstream partition {u.part} kept {u.kept} samples, but "
                        f"{n} entered this stage from it (partitions {', '.join(p.part for p in got) or 'none'}) "
                        f"and the key-set checksums {'match' if s == int(u.kept_sum) else 'differ'}")
        else:
            n, s = sum(p.n_in for p in parts), add_sums(*(p.in_sum for p in parts))
            want_n, want_s = sum(u.kept for u in upstream), add_sums(*(u.kept_sum for u in upstream))
            if n != want_n or s != want_s:
                raise RuntimeError(f"stage {stage}: {want_n} samples were kept upstream, {n} entered this stage "
                                   "(key-set checksums differ): a sample was lost or added between stages")
    names = [p.part for p in parts]
    if len(set(names)) != len(names):
        raise RuntimeError(f"stage {stage}: partition names repeat: {sorted(n for n, c in Counter(names).items() if c > 1)[:3]}")
    dropped: Counter = Counter()
    for p in parts:
        dropped.update(p.dropped)
    kept = sum(p.kept for p in parts)
    return {"in": kept + sum(dropped.values()), "kept": kept, "dropped": dict(sorted(dropped.items()))}


# -- writing a partition -------------------------------------------------------------------------
def conform(table: pa.Table, stage: str) -> pa.Table:
    """Any subset of SAMPLE_SCHEMA's columns -> the full schema (missing ones null), key order."""
    n = table.num_rows
    cols = []
    for f in SAMPLE_SCHEMA:
        if f.name == "stage":
            cols.append(pa.array([stage] * n, pa.string()))
        elif f.name in table.column_names:
            cols.append(table.column(f.name).cast(f.type))
        else:
            cols.append(pa.nulls(n, f.type))
    out = pa.Table.from_arrays(cols, schema=SAMPLE_SCHEMA)
    return out.sort_by("key")


def with_state(verdicts: pa.Table, state: pa.Table) -> pa.Table:
    """The stage's verdicts (key + ledger columns, maybe new state) joined with the input's carried state."""
    verdicts = pa.table({c: verdicts.column(c).cast(SAMPLE_SCHEMA.field(c).type)
                         if SAMPLE_SCHEMA.get_field_index(c) >= 0 else verdicts.column(c)
                         for c in verdicts.column_names})
    keep = [c for c in CARRIED if c in state.column_names and c not in verdicts.column_names]
    if not keep:
        return verdicts
    return verdicts.join(state.select(["key", *keep]), "key", join_type="left outer")


def add_notes(table: pa.Table, stage: str, notes: tuple | None = None) -> pa.Table:
    """Record a kept sample's score and detail in its notes, for the final shards' json, under the
    names the stage declares (Stage.notes: the names img2dataset / DataComp users read, such as
    `clip_score`; None: not recorded there)."""
    score_name, detail_name = notes if notes is not None else (f"{stage}_score", f"{stage}_detail")
    if table.num_rows == 0 or "notes" not in table.column_names:
        return table
    verdict, score, detail = (table.column(c).to_pylist() for c in ("verdict", "score", "detail"))
    notes = table.column("notes").to_pylist()
    out = []
    for v, s, d, n in zip(verdict, score, detail, notes):
        if v != KEPT or ((s is None or not score_name) and (not d or not detail_name)):
            out.append(n)
            continue
        entry = json.loads(n) if n else {}
        if s is not None and score_name:
            entry[score_name] = s
        if d and detail_name:
            entry[detail_name] = d
        out.append(json.dumps(entry, sort_keys=True))
    return table.set_column(table.column_names.index("notes"), "notes", pa.array(out, pa.string()))


def write_part(storage: Storage, stage: str, part: str, input_name: str | None, in_keys, out: pa.Table,
               extra: dict | None = None, rel: str | None = None, notes: tuple | None = None,
               pick: tuple | None = None) -> PartResult:
    """Check and write a partition's ledger; -> its PartResult. `pick` (per_reason, seed, cut): the
    examples page's picks from the rows in hand, as `result.picks` (an attribute, never in
    parts.json: stages/examples.py keeps them by partition), so no task reads the ledger to pick.
    The ledger's keys are stored (`result.stored`) for the stage's key index: a task's stay in
    the object store (pipeline/task_results.Stored), so nothing reads the ledger back to index it."""
    out = add_notes(conform(out, stage), stage, notes)
    keys = out.column("key")
    if len(pc.unique(keys)) != len(keys):
        raise RuntimeError(f"stage {stage}, partition {part}: a sample got two verdicts")
    missing = pc.sum(pc.and_(pc.not_equal(out.column("verdict"), KEPT),
                             pc.equal(pc.fill_null(out.column("reason"), ""), ""))).as_py()
    if missing:
        raise RuntimeError(f"stage {stage}, partition {part}: {missing} dropped samples have no reason")
    rel = rel or part_file(stage, part)
    sha, nbytes = storage.write_table(rel, out)
    hist = score_histogram(out)
    if hist:     # the stage's score chart is the sum of these: nothing reads the ledgers to draw it
        extra = {**(extra or {}), "score_hist": hist}
    result = summarize(stage, part, input_name, in_keys, out, sha, nbytes, extra)
    result.file = rel
    result.stored = Stored(out.select(["key"]))
    if pick is not None and pick[0]:
        result.picks = {"choice": list(pick), "groups": pick_rows(out, *pick)}
    return result


HIST_BINS, HIST_RANGE = 100, (-1.0, 1.0)    # scores of the stages the report charts are cosines or confidences


def score_histogram(table: pa.Table) -> dict[str, dict[str, int]]:
    """A partition's scores binned by verdict, sparse: {"kept"|"dropped": {bin: count}} over
    HIST_BINS bins of HIST_RANGE (values outside go to the end bins); {} without scores."""
    scores = table.column("score")
    if scores.null_count == len(scores):
        return {}
    valid = pc.is_valid(scores)
    lo, hi = HIST_RANGE
    out = {}
    for verdict, mask in (("kept", pc.equal(table.column("verdict"), KEPT)),
                          ("dropped", pc.not_equal(table.column("verdict"), KEPT))):
        v = scores.filter(pc.and_(valid, mask)).to_numpy(zero_copy_only=False)
        if len(v):
            bins = np.clip(((v - lo) / (hi - lo) * HIST_BINS).astype(np.int64), 0, HIST_BINS - 1)
            idx, n = np.unique(bins, return_counts=True)
            out[verdict] = {str(int(i)): int(c) for i, c in zip(idx, n)}
    return out


def sum_histograms(parts: list) -> dict[str, list[int]]:
    """The partitions' `score_hist`es as dense counts per verdict; {} if none has one."""
    total = {"kept": [0] * HIST_BINS, "dropped": [0] * HIST_BINS}
    seen = False
    for p in parts:
        for verdict, bins in p.extra.get("score_hist", {}).items():
            seen = True
            for i, n in bins.items():
                total[verdict][int(i)] += n
    return total if seen else {}


def read_kept(storage: Storage, rel: str, columns=None) -> pa.Table:
    t = storage.read_table(rel, columns=None if columns is None else sorted(set(columns) | {"verdict"}))
    t = t.filter(pc.equal(t.column("verdict"), KEPT))
    return t if columns is None else t.select(columns)


def _rows_below(storage: Storage, file: str, seed: int, below: str, columns: list[str],
                trusted: frozenset | None) -> list[dict]:
    """Ray task: the partition's kept rows whose seeded order key is below `below` (and trusted, if
    listed), each with its `order`."""
    from infra.hashing import order_key

    rows = read_kept(storage, file, ["key", *columns]).to_pylist()
    return [dict(r, order=o) for r in rows if (o := order_key(seed, r["key"])) < below
            and (trusted is None or r["key"] in trusted)]


def first_in_seeded_order(ctx, want: int, pool: int, columns: list[str], what: str,
                          trusted: frozenset | None = None) -> list[dict]:
    """The `want` kept rows (key, `columns`) first in sha256(seed:key) order over the upstream's
    partitions, without sorting them all: each partition's task takes the rows whose order key falls
    under a threshold that should catch a few more of the `pool` rows, widened if it caught too few.
    The one seeded sample (the tokenizer's captions, the bootstrap scorer's pairs)."""
    frac = min(1.0, 1.5 * want / max(1, pool))
    while True:
        below = "f" * 64 if frac >= 1 else format(int(frac * 16 ** 16), "016x") + "0" * 48
        rows = [r for rs in ctx.run(_rows_below, [(ctx.storage, u.file, ctx.seed, below, columns, trusted)
                                                   for u in ctx.upstream or [] if u.kept],
                                    what, num_cpus=0.25, quiet=True) for r in rs]
        if len(rows) >= want or frac >= 1:
            return sorted(rows, key=lambda r: r["order"])[:want]
        frac = min(1.0, frac * 2)


# -- running one task per partition --------------------------------------------------------------
@dataclass
class PartTask:
    """One partition's work: read `file` (the previous stage's part; rows [start, stop) of its kept
    samples), call `fn(table, **kwargs) -> (verdicts table, extra stats)`, write `part`."""
    part: str
    file: str | None
    input: str | None
    start: int = 0
    stop: int | None = None
    kwargs: dict = field(default_factory=dict)
    input_sha: str | None = None      # of `file`: with the stage's fingerprint, what decides the result
    depends: str = ""                 # a digest of anything else that decides it (for reuse)


def run_part(storage: Storage, stage: str, fn: Callable, task: PartTask, rel: str | None = None,
             record: str | None = None, notes: tuple | None = None, pick: tuple | None = None) -> PartResult:
    table = read_kept(storage, task.file) if task.file else pa.table({"key": pa.array([], pa.string())})
    if task.start or task.stop is not None:
        table = table.slice(task.start, (task.stop if task.stop is not None else table.num_rows) - task.start)
    verdicts, extra = fn(table, **task.kwargs)
    result = write_part(storage, stage, task.part, task.input, table.column("key").to_pylist(),
                        with_state(verdicts, table), extra, rel=rel, notes=notes, pick=pick)
    if record:    # last: a partition counts as reusable only once its file is whole
        storage.write_json(record, result.to_json())
    return result


def passthrough(table: pa.Table) -> tuple[pa.Table, dict]:
    """Every sample kept, as it came (stages that learn from the data or consume it)."""
    n = table.num_rows
    return pa.table({"key": table.column("key"), "verdict": pa.array([KEPT] * n, pa.string()),
                     "reason": pa.array([""] * n, pa.string())}), {}


REUSE = "reuse"    # <stage>/reuse/<key>.{parquet,json}: a pure stage's partitions, by what decided them


def reuse_key(fingerprint: str, task: PartTask) -> str | None:
    if task.input_sha is None:
        return None
    text = json.dumps([fingerprint, task.part, task.input, task.input_sha, task.start, task.stop,
                       sorted(task.kwargs)] + ([task.depends] if task.depends else []), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def one_to_one(upstream: list[PartResult], **kwargs) -> list[PartTask]:
    """A task per upstream partition, named like it (the usual shape of a per-sample stage)."""
    return [PartTask(part=u.part, file=u.file, input=u.part, kwargs=kwargs, input_sha=u.sha256)
            for u in upstream]


# -- images through the sample index -------------------------------------------------------------
def read_images(storage: Storage, table: pa.Table, counter: dict | None = None) -> list[bytes | None]:
    """The image bytes of each row (tar, offset, size from the sample index), each tar read in a few
    large requests (infra/tars.py)."""
    from infra.tars import read_members

    return read_members(storage, *(table.column(c).to_pylist() for c in ("tar", "offset", "size")), counter=counter)


BATCH_ROWS, BATCH_BYTES = 2048, 256 << 20   # images a task holds at once, whatever its partition's size


def by_location(table: pa.Table) -> pa.Table:
    """Rows in the order their images lie: by tar, then offset (a batch then reads one tar, or a few,
    in a few large requests, however the partition's rows are ordered)."""
    return table.sort_by([("tar", "ascending"), ("offset", "ascending"), ("key", "ascending")])


def image_batches(storage: Storage, table: pa.Table, batch_rows: int = BATCH_ROWS, batch_bytes: int = BATCH_BYTES,
                  counter: dict | None = None):
    """(rows, their image bytes) a batch at a time, in `table`'s order: at most `batch_rows` rows and
    about `batch_bytes` of images each, so a task's memory does not grow with its partition (sort
    with `by_location` first, so each batch reads few tars)."""
    sizes = pc.fill_null(table.column("size"), 0).to_numpy() if table.num_rows else []
    start, held = 0, 0
    for i in range(table.num_rows):
        held += int(sizes[i])
        if i + 1 - start >= batch_rows or held >= batch_bytes or i + 1 == table.num_rows:
            batch = table.slice(start, i + 1 - start)
            yield batch, read_images(storage, batch, counter)
            start, held = i + 1, 0


PICTURE_COLUMNS = ("tar", "offset", "size", "width", "height")   # what `pictures` reads of a row


def pictures(batch: pa.Table, images: list) -> list:
    """Each row's picture as every image model and descriptor should see it: decoded (RGB PIL, the
    untrusted-input policy) and without the bars a `border` resize padded it with (infra.media.unpad,
    from the original width and height the sample index keeps); None where it does not decode."""
    from infra.media import decode, unpad

    sizes = zip(*(batch.column(c).to_pylist() if c in batch.column_names else [None] * batch.num_rows
                  for c in ("width", "height")))
    out = []
    for data, (w, h) in zip(images, sizes):
        try:
            out.append(unpad(decode(data), w, h))
        except Exception:  # noqa: BLE001 - ingest verified decodability; the caller counts a None
            out.append(None)
    return out


def picture_batches(storage: Storage, table: pa.Table, **options):
    """`image_batches`, each batch's images as `pictures`."""
    for batch, images in image_batches(storage, table, **options):
        yield batch, pictures(batch, images)


# The fewest rows a partition's task is given a worker process of its own for. A process Ray starts
# costs ~1 s of CPU (Ray's worker, then pyarrow, numpy, the stage's modules) before its first row;
# a partition of a few rows is done in 0.1-0.5 s, most of it waiting on the bucket. An append of 20
# partitions of 4 rows to a line of 2,000, on a head declaring 16 CPUs (2 real), ran dedup's verdicts
# 13 at once: 10 new processes, 3.5 s a task where the fresh run's warm ones took 0.7 s.
ROWS_PER_WORKER = 16


def rows_of(items: list, upstream: list | None) -> list[int] | None:
    """How many rows each item (a PartResult, or a PartTask over an upstream partition) works through,
    for the task window; None when one cannot be told."""
    kept = {u.file: u.kept for u in upstream or []}
    named = {u.part: u.kept for u in upstream or []}
    out = []
    for item in items:
        if isinstance(item, PartResult):
            out.append(item.kept)
        elif isinstance(item, PartTask) and item.stop is not None:
            out.append(item.stop - item.start)
        elif isinstance(item, PartTask) and item.file in kept:
            out.append(max(0, kept[item.file] - item.start))
        elif isinstance(item, PartTask) and item.input in named:     # a file made from it (its scores)
            out.append(max(0, named[item.input] - item.start))
        else:
            return None
    return out


def reused_or_run(ctx, fn: Callable, folder: str, key_of: Callable, call_of: Callable, what: str, done_before: str,
                  verb: str, items: list | None = None, given: dict | None = None,
                  encode: Callable | None = None, decode: Callable | None = None,
                  **options) -> tuple[list, dict[str, str]]:
    """capline's one reuse mechanism: `fn` over the upstream partitions (or `items`: PartResults,
    PartTasks), except those an earlier run already did with the same inputs. Each item's outputs are
    `<folder>/<key_of(item)>.*`, the task writing `.json` (its record) last, so a record found means
    whole outputs; a key of None means "not reusable": run, nothing recorded. `call_of(item, out)`
    makes a task's arguments; `given`: partition -> a result already in hand (made by the task that
    wrote the partition), recorded as if a task had returned it; `encode`/`decode`: a result to and
    from its record (default: the result is the record). The records are read in one request (the
    folder's summary; records.py), written back as one; files no item maps to now are deleted
    together. -> (results in item order, partition -> its output prefix)."""
    from . import records

    upstream = items if items is not None else ctx.upstream or []
    outs = [f"{folder}/{k}" if (k := key_of(u)) else None for u in upstream]
    previous = records.read_summary(ctx.storage, folder)
    given = given or {}
    found = records.find(ctx.storage, {o: f"{o}.json" for u, o in zip(upstream, outs) if o and u.part not in given},
                         summaries={folder: previous})
    results: list = [None] * len(upstream)
    todo = []
    for i, (u, o) in enumerate(zip(upstream, outs)):
        if o in found:
            results[i] = decode(found[o]) if decode else found[o]
        elif u.part in given:
            results[i] = given[u.part]
        else:
            todo.append(i)
    reused = sum(o in found for o in outs)
    if reused:
        ctx.log(f"{ctx.name}: {reused} partitions {done_before}, reused; {len(todo)} to {verb}")
    options.setdefault("describe", lambda c: f"partition {c[1]}")
    rows = rows_of([upstream[i] for i in todo], ctx.upstream)
    if rows is not None:    # small work: on the worker processes already started
        options.setdefault("sizes", rows)
        options.setdefault("items_per_worker", ROWS_PER_WORKER)
    for i, r in zip(todo, ctx.run(fn, [call_of(upstream[i], outs[i]) for i in todo], what, **options)):
        results[i] = r
    records.write_summary(ctx.storage, folder, {f"{o}.json": encode(r) if encode else r
                                                for o, r in zip(outs, results) if o})
    keep = {o for o in outs if o}           # keys hold no "."
    # items gone from the input, or made under another config: deleted together
    ctx.storage.delete_files(records.stale_files(
        ctx.storage, folder, {f"{o}.json" for o in keep}, previous,
        keep=lambda f: f"{folder}/{f.rsplit('/', 1)[-1].split('.', 1)[0]}" in keep))
    return results, {u.part: o for u, o in zip(upstream, outs)}
