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
ENDED_REMOVALS = f"{LINE}/ended_removals.json"   # the removals of a line that ended (append: false), still in force
DESCRIPTIONS = "dedup/descriptions.json"      # partition -> its description file (written by dedup)
# A removal's journal (pipeline/remove.py): decided (what goes, from which shards) before any shard is
# rewritten, deleted once the line, its lists and the manifest record it. While it is there the line is
# half removed: its shards may lack samples that removed.parquet does not name yet.
PENDING = f"{LINE}/removal_pending.json"
PENDING_ROWS = f"{LINE}/removal_pending.parquet"    # its rows for removed.parquet


def half_done(storage, where: str = "RUN") -> str | None:
    """A one-line account of an interrupted removal and how to finish it, or None."""
    pending = storage.read_json(PENDING)
    if pending is None:
        return None
    return (f"removal {pending.get('removal')} of this dataset line ({str(pending.get('reason'))[:80]!r}, started "
            f"{pending.get('at')}) was interrupted: its shards may already be rewritten while the line does not "
            f"record it; run `capline remove {where} --finish` to finish it (it says what it takes out)")


def unit_rows(blob: list[bytes]) -> np.ndarray:
    v = np.frombuffer(b"".join(blob), np.float16).reshape(len(blob), -1).astype(np.float32) if blob else np.zeros((0, 768), np.float32)
    return v / (np.linalg.norm(v, axis=1, keepdims=True) + 1e-6)


def unit_or_none(blob: list[bytes | None], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, dim) unit rows of float16 descriptors, zeros where one is missing; and which are there."""
    have = np.array([b is not None and len(b) == 2 * dim for b in blob], bool)
    out = np.zeros((len(blob), dim), np.float32)
    if have.any():
        out[have] = unit_rows([b for b, h in zip(blob, have) if h])
    return out, have


# removed references past which a sample's candidates come from a Hamming index over their SimHash
# codes (dedup's evaluation search: stages/dedup/neardup.py) instead of every reference: 10^4 samples
# against 10^6 references is 7.7 TFLOP a partition by brute force
ANN_ABOVE = 20_000
CANDIDATES = 16


def ref_index(ref_vecs: np.ndarray):
    """The Hamming index `near_copies` searches for candidates, or None (few references: all compared)."""
    if len(ref_vecs) <= ANN_ABOVE:
        return None
    from ..dedup.imagehash import simhash
    from ..dedup.neardup import binary_index

    return binary_index(simhash(np.ascontiguousarray(ref_vecs, np.float32)), 256)


def near_copies(vecs: np.ndarray, details: np.ndarray, has_detail: np.ndarray, ref_vecs: np.ndarray,
                ref_details: np.ndarray, ref_has_detail: np.ndarray, threshold: np.ndarray,
                detail_threshold: np.ndarray, index=None, chunk: int = 512) -> list[tuple[int, float] | None]:
    """For each sample (unit rows `vecs` (n, 768), `details` (n, 576)): the removed image it is a
    near copy of, as (index, thumbnail cosine), or None. A near copy is what dedup's within-data rule
    joins: the 16x16 thumbnail within the reference's `threshold`, then the 24x24 detail within its
    `detail_threshold` where both have one and it is > 0 (a removal recorded before the detail was,
    or with the check off, compares the thumbnail alone). Without the detail, a takedown of one shirt
    photographed on white took every shirt photographed alike with it (the thumbnail alone joins
    44.6 % of 4,000 distinct garments shot alike: benchmarks/dedup_real.py --data products).
    `index` (`ref_index`): each sample is compared with its CANDIDATES nearest references by
    Hamming distance only; without it, with every reference."""
    if not len(vecs) or not len(ref_vecs):
        return [None] * len(vecs)
    out: list[tuple[int, float] | None] = []
    if index is not None:
        from ..dedup.imagehash import simhash

        _, found = index.search(simhash(np.ascontiguousarray(vecs, np.float32)), min(CANDIDATES, len(ref_vecs)))
    for a in range(0, len(vecs), chunk):
        q, qd, qh = vecs[a:a + chunk], details[a:a + chunk], has_detail[a:a + chunk]
        if index is None:      # every reference a candidate of every sample: broadcast, never gathered
            cand = None
            valid, cut, dcut, rh = True, threshold[None, :], detail_threshold[None, :], ref_has_detail[None, :]
            sims = q @ ref_vecs.T
            dsims = (lambda: qd @ ref_details.T)   # noqa: E731 - only where a detail is checked
        else:
            valid = found[a:a + chunk] >= 0
            cand = np.where(valid, found[a:a + chunk], 0)
            cut, dcut, rh = threshold[cand], detail_threshold[cand], ref_has_detail[cand]
            sims = np.einsum("qkd,qd->qk", ref_vecs[cand].astype(np.float32), q)
            dsims = (lambda: np.einsum("qkd,qd->qk", ref_details[cand].astype(np.float32), qd))   # noqa: E731
        ok = valid & (sims >= cut)
        checked = qh[:, None] & rh & (dcut > 0)
        if (ok & checked).any():
            ok &= ~checked | (dsims() >= dcut)
        best = np.where(ok, sims - cut, -np.inf).argmax(axis=1)
        out += [(int(j if cand is None else cand[i, j]), float(sims[i, j])) if ok[i, j] else None
                for i, j in enumerate(best)]
    return out


def near_copies_of(keys: list[str], vecs: dict, details: dict, framed: dict, ref_vecs: np.ndarray,
                   ref_details: np.ndarray, ref_has_detail: np.ndarray, threshold: np.ndarray,
                   detail_threshold: np.ndarray, index=None) -> list[tuple[int, float] | None]:
    """`near_copies` of samples by key (`vecs`, `details`: key -> the float16 descriptors dedup's
    describe step wrote), each searched as a whole and, where that step found it inside bars of one
    flat colour (`framed`: key -> (thumbnail, detail) of the picture inside), once more inside them,
    as dedup's evaluation search does: a removed image re-hosted in a coloured frame is otherwise the
    framed whole's descriptor, and was found 0 of 8 times."""
    from ..dedup.imagehash import DETAIL_DIM

    rows = [(i, vecs[k], details.get(k)) for i, k in enumerate(keys)]
    rows += [(i, *framed[k]) for i, k in enumerate(keys) if framed.get(k) and framed[k][0]]
    sd, has = unit_or_none([d for _, _, d in rows], DETAIL_DIM)
    found = near_copies(unit_rows([v for _, v, _ in rows]), sd, has, ref_vecs, ref_details, ref_has_detail,
                        threshold, detail_threshold, index)
    out: list[tuple[int, float] | None] = [None] * len(keys)
    for (i, _, _), hit in zip(rows, found):
        if hit is not None and (out[i] is None or hit[1] > out[i][1]):
            out[i] = hit
    return out


def framed_of(desc: pa.Table) -> dict:
    """key -> (thumbnail, detail) of the picture inside a flat frame, from a description file's
    columns (a line described before layout 5 has none)."""
    if "framed_vec" not in desc.column_names:
        return {}
    keys, fv, fd = (desc.column(c).to_pylist() for c in ("key", "framed_vec", "framed_detail"))
    return {k: (v, d) for k, v, d in zip(keys, fv, fd) if v is not None}


def removal_digest(storage) -> str | None:
    """What later runs' dedup verdicts depend on: the removals the line records (None: none). (A
    removal that was interrupted is refused before any stage runs: pipeline/runner.py.)"""
    line = read_line(storage)
    removals = (line or {}).get("removals") or ([] if line else storage.read_json(ENDED_REMOVALS) or [])
    return hashlib.sha256(json.dumps(removals, sort_keys=True).encode()).hexdigest()[:16] if removals else None


_INDEX: dict = {}      # (removed.parquet's place, the removals' digest) -> _Removed, per worker process


class _Removed:
    """removed.parquet as lookups: key, URL and sha256 -> (removal, reason), and the described
    references as unit rows (thumbnail, detail) with their thresholds."""

    def __init__(self, r: pa.Table):
        from ..dedup.imagehash import DETAIL_DIM

        kinds, values = r.column("kind").to_pylist(), r.column("value").to_pylist()
        self.nums, self.reasons = r.column("removal").to_pylist(), r.column("reason").to_pylist()
        rkeys, rurls, rshas = (r.column(c).to_pylist() for c in ("key", "url", "sha256"))
        self.by = {"key": {}, "url": {}, "sha256": {}}
        for kind, value, key, url, sha, n, why in zip(kinds, values, rkeys, rurls, rshas, self.nums, self.reasons):
            if kind in self.by:
                self.by[kind].setdefault(value, (n, why))
            elif kind == "sample":
                for col, v in (("key", key), ("url", url), ("sha256", sha)):
                    if v:
                        self.by[col].setdefault(v, (n, why))
        self.names = [k or v for k, v in zip(rkeys, values)]
        self.have = np.flatnonzero(pc.is_valid(r.column("vec")).to_numpy(zero_copy_only=False)).tolist()
        described = r.take(pa.array(self.have, pa.int64()))
        # a removal recorded before the detail was (no such columns): the thumbnail alone, as then
        ref_details = (described.column("detail").to_pylist() if "detail" in described.column_names
                       else [None] * len(self.have))
        self.detail_cut = (described.column("detail_threshold").fill_null(0.0).to_numpy(zero_copy_only=False)
                           if "detail_threshold" in described.column_names else np.zeros(len(self.have)))
        self.details, self.has_detail = unit_or_none(ref_details, DETAIL_DIM)
        self.vecs = unit_rows(described.column("vec").to_pylist())
        self.cut = described.column("threshold").to_numpy(zero_copy_only=False)
        self.index = ref_index(self.vecs)
        if self.index is not None:     # searched by candidates: kept as float16, half the memory
            self.vecs, self.details = self.vecs.astype(np.float16), self.details.astype(np.float16)


def _removed(storage, digest: str | None) -> _Removed | None:
    """The line's removals, read and indexed once per worker process for a digest (every verdict
    task read and parsed the whole file: 10^6 entries cost 4.9 s and 688 MB a task)."""
    key = (storage.uri(REMOVED), digest)
    if digest is None or key not in _INDEX:
        try:
            index = _Removed(storage.read_table(REMOVED))
        except (FileNotFoundError, OSError):
            return None
        if digest is None:
            return index
        _INDEX.clear()
        _INDEX[key] = index
    return _INDEX[key]


def blocked(storage, table: pa.Table, vecs: dict[str, bytes], details: dict[str, bytes] | None = None,
            digest: str | None = None, framed: dict | None = None) -> dict[str, str]:
    """For the dedup stage of a later run: key -> why, for the samples of `table` (key, url, sha256)
    that a removal names, or that are near copies of a removed image or sample (`vecs`, `details`:
    key -> the sample's thumbnail and detail descriptors, as dedup's describe step wrote them;
    `framed`: those of the picture inside a flat frame, `framed_of`).
    `digest` (removal_digest): the removals it names, indexed once per process."""
    r = _removed(storage, digest)
    if r is None:
        return {}
    out = {}
    cols = {c: table.column(c).to_pylist() if c in table.column_names else [None] * table.num_rows
            for c in ("key", "url", "sha256")}
    for i, key in enumerate(cols["key"]):
        for col in ("key", "url", "sha256"):
            hit = r.by[col].get(cols[col][i])
            if hit:
                out[key] = f"removal {hit[0]} ({col}): {hit[1]}"
                break
    todo = [k for k in cols["key"] if k not in out and vecs.get(k)]
    if r.have and todo:
        found = near_copies_of(todo, vecs, details or {}, framed or {}, r.vecs, r.details, r.has_detail,
                               r.cut, r.detail_cut, r.index)
        for k, hit in zip(todo, found):
            if hit is not None:
                j, sim = hit
                i = r.have[j]
                out[k] = f"removal {r.nums[i]} (near copy of {r.names[i]}, cosine {sim:.3f}): {r.reasons[i]}"
    return out
