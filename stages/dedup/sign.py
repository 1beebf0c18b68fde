"""Step 3: a partition's signatures for this run's band plan, from its descriptions (no image decoded again)."""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pyarrow as pa

from infra.shuffle import write_ranges

from .layout import PIXELS, SIG_SCHEMA, URL_CAPTION, Signed
from .lsh import BandPlan, band_values, mix64
from .config import DedupConfig, eval_hit


def sigs_per_sample(plan: BandPlan) -> int:
    return 2 + plan.bands          # its pixel hash, its URL+caption hash, a value per band


def bucket_count(samples: int, bucket_rows: int, cluster_cpus: float, per_sample: int) -> int:
    """Signature buckets (group tasks) for `samples` described images of `per_sample` signatures:
    enough that a bucket holds about `bucket_rows` signature rows, and at least one per CPU of the
    cluster while each still gets MIN_BUCKET_ROWS: every bucket costs each of its reducers a request
    per map file, which small data would pay for nothing. The pairs found do not depend on it."""
    rows = samples * per_sample
    by_size = math.ceil(rows / bucket_rows)
    return max(1, by_size, min(int(cluster_cpus), rows // MIN_BUCKET_ROWS))


MIN_BUCKET_ROWS = 100_000
SIGN_COLUMNS = ["key", "ok", "eval_set", "eval_sim", "code", "mean", "pixels", "url_caption"]


def _sign_task(storage, part: str, desc: str, cfg: DedupConfig, plan: BandPlan, n_buckets: int, out: str) -> Signed:
    """Ray task: one partition's signatures for the band plan of this run's size, from its
    descriptions (`desc`): of the samples the within-data step considers (decodable, not an
    evaluation match), sorted by their hash, a row group per range bucket of `n_buckets`, as one
    file (infra/shuffle.py: no file per (partition, bucket)); then its record. -> small counts."""
    return sign_rows(storage, part, storage.read_table(desc, SIGN_COLUMNS), cfg, plan, n_buckets, out)


def sign_rows(storage, part: str, t, cfg: DedupConfig, plan: BandPlan, n_buckets: int, out: str) -> Signed:
    """`_sign_task` on descriptions in hand (SIGN_COLUMNS): the describe task signs what it just
    described, so an append's new partitions need no sign task of their own."""
    ok, sets, sims = (t.column(c).to_pylist() for c in ("ok", "eval_set", "eval_sim"))
    live = np.array([i for i in range(t.num_rows) if ok[i] and not eval_hit(sets[i], sims[i], cfg)], np.int64)
    t = t.take(live)
    codes = _packed(t.column("code"), cfg.bits // 8)
    means = t.column("mean").combine_chunks().flatten().to_numpy().reshape(-1, 3)
    table = signature_table(t.column("key").to_pylist(), part, codes, means, t.column("pixels").to_pylist(),
                            t.column("url_caption").to_pylist(), plan)
    write_ranges(storage, f"{out}.sig.parquet", table, "h32", n_buckets)
    result = Signed(part, t.num_rows, out)
    storage.write_json(f"{out}.json", result.to_json())     # last: the file above is whole
    return result


def _signed_key(part: str, described: str, plan: BandPlan) -> str:
    """A partition's signatures: its descriptions and the band plan (it grows with N, in steps)."""
    text = json.dumps([described, plan.width, plan.bands, plan.bits])
    return f"{part}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


SIGNED = "dedup/signed"          # per partition and band plan: kept across runs too


def signature_table(keys: list[str], part: str, codes: np.ndarray, means: np.ndarray, pixels: list[bytes],
                    url_caption: list[bytes], plan: BandPlan) -> pa.Table:
    """A row per (sample, signature), built column-wise: codes (n, bits/8) uint8, means (n, 3), the
    16-byte pixel and URL+caption hashes. Each row carries the sample's code and mean colour, so a
    group task needs nothing else; its bucket is a range of `h32`, a hash of the signature
    (infra/shuffle.py: range buckets, so the file serves whatever number of buckets a later, larger
    run needs)."""
    n, per = len(keys), sigs_per_sample(plan)
    kind = np.repeat(np.arange(per, dtype=np.int16), n)                   # (per * n,) signature-major
    hi, lo = np.zeros(per * n, np.uint64), np.zeros(per * n, np.uint64)
    for k, hashes in ((PIXELS, pixels), (URL_CAPTION, url_caption)):
        h = np.frombuffer(b"".join(hashes), "<u8").reshape(n, 2) if n else np.zeros((0, 2), np.uint64)
        hi[k * n:(k + 1) * n], lo[k * n:(k + 1) * n] = h[:, 0], h[:, 1]
    if n:
        hi[2 * n:] = band_values(codes, plan).ravel()
    with np.errstate(over="ignore"):
        h32 = (mix64(hi ^ mix64(lo ^ kind.astype(np.uint64))) >> np.uint64(32)).astype(np.uint32)
    sample = np.tile(np.arange(n), per)
    return pa.table({"sig_kind": kind, "sig_hi": hi, "sig_lo": lo,
                     "key": pa.array(keys, pa.string()).take(sample),
                     "part": pa.array([part], pa.string()).take(np.zeros(per * n, np.int64)),
                     "code": pa.array([c.tobytes() for c in codes], pa.binary()).take(sample),
                     "mean": pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(means, np.float32).ravel()),
                                                               3).take(sample),
                     "h32": h32}, schema=SIG_SCHEMA)


def _packed(column, width: int) -> np.ndarray:
    """A binary column whose values are all `width` bytes -> (n, width) uint8, without a copy per row."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(arr) == 0:
        return np.zeros((0, width), np.uint8)
    offsets = np.frombuffer(arr.buffers()[1], np.int32)[arr.offset:arr.offset + len(arr) + 1]
    data = np.frombuffer(arr.buffers()[2], np.uint8)[offsets[0]:offsets[-1]]
    return data.reshape(len(arr), width)
