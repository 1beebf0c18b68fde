"""One near-duplicate index for both descriptor kinds (thumbnail hashes, or encoder embeddings).

Items are (id, unit vector, mean colour). `search` finds the nearest indexed item of each query:
candidates by Hamming distance over SimHash codes in a faiss binary index (exact for small sets, an
inverted file past `ivf_above` codes so millions stay fast), then exact cosine on those candidates, keeping
only ones whose mean colour is within `colour_tol` per channel (None: no colour check, as for
embeddings). Saved and loaded as one .npz, codes included; a loaded index travels to the dedup
workers as arrays in Ray's object store (`arrays` / `from_arrays`), which every worker process on a
node reads from the same shared memory, not a copy each: an evaluation set of 50,000 images is
1.4 million 768-d references (4.3 GB), once per node.
"""
from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np

from .imagehash import simhash


class NearDupIndex:
    def __init__(self, bits: int = 256, colour_tol: float | None = 12.0, k: int = 16, ivf_above: int = 1_000_000):
        self.bits, self.colour_tol, self.k, self.ivf_above = bits, colour_tol, k, ivf_above
        self.ids = np.zeros(0, str)          # (n,) reference ids, a numpy array (shared, not n Python strings)
        self.vecs = np.zeros((0, 0), np.float32)
        self.means = np.zeros((0, 3), np.float32)
        self.codes = np.zeros((0, bits // 8), np.uint8)
        self.index = None

    def build(self, ids, vecs: np.ndarray, means: np.ndarray, codes: np.ndarray | None = None,
              trained: np.ndarray | None = None) -> "NearDupIndex":
        """Arrays that are contiguous and of the right type are used as they are (no copy): a
        read-only view of the object store's memory serves as well as an array of one's own.
        `trained`: the inverted file `arrays()` serialised, read back instead of trained again (an
        evaluation set of 50,000 images took each describe process ~220 s to train on 2 cores)."""
        self.ids = np.asarray(ids) if len(ids) else np.zeros(0, str)
        self.vecs = np.ascontiguousarray(vecs, np.float32)
        self.means = np.ascontiguousarray(means, np.float32)
        self.codes = np.ascontiguousarray(codes, np.uint8) if codes is not None else simhash(self.vecs, self.bits)
        if trained is not None and len(self.codes) > self.ivf_above:
            self.index = faiss.deserialize_index_binary(np.ascontiguousarray(trained, np.uint8))
            self.index.nprobe = NPROBE
        else:
            self.index = binary_index(self.codes, self.bits, self.ivf_above)
        return self

    def arrays(self) -> dict[str, np.ndarray]:
        """What `from_arrays` (a worker) and `load` rebuild the index from; an inverted file travels
        trained, since training is what costs (an exact index is built from the codes in moments)."""
        out = {"ids": self.ids, "vecs": self.vecs, "means": self.means, "codes": self.codes,
               "params": np.array([self.bits, -1 if self.colour_tol is None else self.colour_tol, self.k])}
        if isinstance(self.index, faiss.IndexBinaryIVF):
            out["trained"] = faiss.serialize_index_binary(self.index)
        return out

    @classmethod
    def from_arrays(cls, data, ivf_above: int = 1_000_000) -> "NearDupIndex":
        bits, tol, k = data["params"]
        idx = cls(int(bits), None if tol < 0 else float(tol), int(k), ivf_above)
        codes = data["codes"] if "codes" in data else None      # an index saved before codes were kept
        return idx.build(data["ids"], data["vecs"], data["means"], codes, data["trained"] if "trained" in data else None)

    def search(self, vecs: np.ndarray, means: np.ndarray, exclude_self: bool = False,
               chunk: int = 512) -> tuple[np.ndarray, np.ndarray]:
        """-> (index of the best match or -1, its cosine or -1) for each query row."""
        n = len(vecs)
        best_i = np.full(n, -1, np.int64)
        best_s = np.full(n, -1.0, np.float32)
        if not len(self.ids) or n == 0:
            return best_i, best_s
        vecs = np.ascontiguousarray(vecs, np.float32)
        k = min(self.k + (1 if exclude_self else 0), len(self.ids))
        _, cand = self.index.search(simhash(vecs, self.bits), k)                  # (n, k), -1 = none
        for a in range(0, n, chunk):
            c = cand[a:a + chunk]
            valid = c >= 0
            if exclude_self:
                valid &= c != np.arange(a, a + len(c))[:, None]
            cc = np.where(valid, c, 0)
            sims = np.einsum("qkd,qd->qk", self.vecs[cc], vecs[a:a + chunk])   # exact cosine
            if self.colour_tol is not None:
                valid &= np.abs(self.means[cc] - means[a:a + chunk, None]).max(-1) <= self.colour_tol
            sims = np.where(valid, sims, -1.0)
            j = sims.argmax(1)
            s = sims[np.arange(len(c)), j]
            hit = s > -1
            best_i[a:a + chunk][hit] = cc[np.arange(len(c)), j][hit]
            best_s[a:a + chunk][hit] = s[hit]
        return best_i, best_s

    def nearest_other(self, rows: np.ndarray, k: int = 64) -> np.ndarray:
        """-> for each of these reference rows, the cosine of its nearest reference with another id
        (colour-checked as `search` does), or -1: how alike the indexed images are to each other
        under this descriptor. `k` Hamming candidates, more than an image's own crops (28)."""
        rows = np.asarray(rows, np.int64)
        if not len(rows) or len(self.ids) < 2:
            return np.full(len(rows), -1.0, np.float32)
        _, cand = self.index.search(self.codes[rows], min(k, len(self.ids)))
        valid = cand >= 0
        cc = np.where(valid, cand, 0)
        valid &= self.ids[cc] != self.ids[rows][:, None]
        if self.colour_tol is not None:
            valid &= np.abs(self.means[cc] - self.means[rows][:, None]).max(-1) <= self.colour_tol
        sims = np.einsum("qkd,qd->qk", self.vecs[cc], self.vecs[rows])
        return np.where(valid, sims, -1.0).max(1).astype(np.float32)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **{**self.arrays(), "ids": np.array(self.ids, dtype=str)})
        tmp.rename(path)

    @classmethod
    def load(cls, path: Path, ivf_above: int = 1_000_000) -> "NearDupIndex":
        with np.load(path) as data:
            return cls.from_arrays({name: data[name] for name in data.files}, ivf_above)


# inverted lists an IVF search visits: at 50,000 Fashion-MNIST images (1.4 M references, 4,733
# lists) 16 found 1,429 of the 1,466 re-hosted copies an exact search finds, 64 found 1,463, the
# 2,000 searches taking 0.19 and 0.21 s (benchmarks/eval_recall.py; describing them takes longer)
NPROBE = 64


def search_plan(arrays: dict) -> str:
    """How an index's arrays (`arrays()`) are searched, where that is not exact: what a search's
    results depend on beyond the references, for the reuse keys of what was searched."""
    return f"ivf-nprobe{NPROBE}" if "trained" in arrays else ""


def binary_index(codes: np.ndarray, bits: int, ivf_above: int = 1_000_000, nprobe: int = NPROBE):
    """Exact Hamming search up to `ivf_above` codes; past it an inverted file (trained on a sample)."""
    n = len(codes)
    if n <= ivf_above:
        index = faiss.IndexBinaryFlat(bits)
    else:
        nlist = int(4 * np.sqrt(n))
        index = faiss.IndexBinaryIVF(faiss.IndexBinaryFlat(bits), bits, nlist)
        sample = codes[np.random.default_rng(0).choice(n, size=min(n, 64 * nlist), replace=False)]
        index.train(sample)
        index.nprobe = nprobe
    if n:
        index.add(codes)
    return index
