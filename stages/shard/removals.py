"""A dataset line's removals as every later run applies them (`capline remove`, pipeline/remove.py,
records them): the dedup stage drops a sample a removal names (key, URL, sha256) or a near copy of a
removed image, with reason `removed`, before anything is published."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .line import LINE, read_line

REMOVED = f"{LINE}/removed.parquet"
DESCRIPTIONS = "dedup/descriptions.json"      # partition -> its description file (written by dedup)


def unit_rows(blob: list[bytes]) -> np.ndarray:
    v = np.frombuffer(b"".join(blob), np.float16).reshape(len(blob), -1).astype(np.float32) if blob else np.zeros((0, 768), np.float32)
    return v / (np.linalg.norm(v, axis=1, keepdims=True) + 1e-6)


def removal_digest(storage) -> str | None:
    """What later runs' dedup verdicts depend on: the removals the line records (None: none)."""
    line = read_line(storage)
    removals = (line or {}).get("removals") or []
    return hashlib.sha256(json.dumps(removals, sort_keys=True).encode()).hexdigest()[:16] if removals else None


def blocked(storage, table: pa.Table, vecs: dict[str, bytes]) -> dict[str, str]:
    """For the dedup stage of a later run: key -> why, for the samples of `table` (key, url, sha256)
    that a removal names, or that are near copies of a removed image or sample (`vecs`: key -> the
    sample's descriptor)."""
    try:
        r = storage.read_table(REMOVED)
    except (FileNotFoundError, OSError):
        return {}
    kinds, values = r.column("kind").to_pylist(), r.column("value").to_pylist()
    nums, reasons = r.column("removal").to_pylist(), r.column("reason").to_pylist()
    rkeys, rurls, rshas = (r.column(c).to_pylist() for c in ("key", "url", "sha256"))
    by = {"key": {}, "url": {}, "sha256": {}}
    for kind, value, key, url, sha, n, why in zip(kinds, values, rkeys, rurls, rshas, nums, reasons):
        if kind in by:
            by[kind].setdefault(value, (n, why))
        elif kind == "sample":
            for col, v in (("key", key), ("url", url), ("sha256", sha)):
                if v:
                    by[col].setdefault(v, (n, why))
    out = {}
    cols = {c: table.column(c).to_pylist() if c in table.column_names else [None] * table.num_rows
            for c in ("key", "url", "sha256")}
    for i, key in enumerate(cols["key"]):
        for col in ("key", "url", "sha256"):
            hit = by[col].get(cols[col][i])
            if hit:
                out[key] = f"removal {hit[0]} ({col}): {hit[1]}"
                break
    have = np.flatnonzero(pc.is_valid(r.column("vec")).to_numpy(zero_copy_only=False)).tolist()
    todo = [k for k in cols["key"] if k not in out and vecs.get(k)]
    if have and todo:
        described = r.take(pa.array(have, pa.int64()))
        rv = unit_rows(described.column("vec").to_pylist())
        thr = described.column("threshold").to_numpy(zero_copy_only=False)
        sims = unit_rows([vecs[k] for k in todo]) @ rv.T
        for k, row in zip(todo, sims):
            j = int(np.argmax(row - thr))
            if row[j] >= thr[j]:
                i = have[j]
                out[k] = (f"removal {nums[i]} (near copy of {rkeys[i] or values[i]}, cosine {row[j]:.3f}): "
                          f"{reasons[i]}")
    return out
