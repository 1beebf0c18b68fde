"""Banded LSH over SimHash codes, planned from the data's size, and the vectorised search of a group
of signatures for close pairs.

A band is `width` bits of the code at fixed random positions; two codes whose bands agree land in
one group and are compared in full. For random codes a band value is shared by about N / 2^width
codes, so the width grows with N (log2(N / GROUP)): a group's expected size stays bounded, and the
work is linear in N, not quadratic. Wider bands agree less often for a true near pair, so the number
of bands grows too, until a pair exactly at the cosine threshold is found with probability RECALL.
For SimHash each bit differs with probability p = acos(threshold) / pi, so a pair differs in
k ~ Binomial(bits, p) bits; a band of `width` random positions misses all k with probability
C(bits - k, width) / C(bits, width), independently per band given the k bits, so

    recall = sum_k P(k) * (1 - (1 - C(bits - k, width) / C(bits, width)) ** bands)

(the simpler (1 - p) ** width per band, as if bands were independent, overstates it: 0.99 by that
formula measured 0.97).

Shapes: codes (n, bits/8) uint8 packed; positions (bands, width) bit indices into the code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

RECALL = 0.98        # of pairs exactly at the threshold; pairs closer than it are found more often
GROUP = 16           # random codes expected to share one band value, whatever N
MIN_WIDTH, MAX_WIDTH, MAX_BANDS = 16, 64, 128
SMALL_GROUP = 64     # groups up to this size are compared all at once, larger ones a block at a time
PAIR_CHUNK = 1 << 18  # candidate pairs held at once (~40 MB of gathered codes)


@dataclass(frozen=True)
class BandPlan:
    width: int
    bands: int
    bits: int

    @property
    def positions(self) -> np.ndarray:
        """(bands, width): each band's bit positions, a fixed draw per (width, band)."""
        return np.stack([np.random.default_rng([self.width, b]).permutation(self.bits)[:self.width]
                         for b in range(self.bands)])

    def recall_at(self, threshold: float) -> float:
        return expected_recall(self.width, self.bands, self.bits, threshold)

    def describe(self, threshold: float) -> str:
        return (f"{self.bands} bands of {self.width} bits (random positions in {self.bits}); "
                f"expected recall {self.recall_at(threshold):.3f} at cosine {threshold:g}")


def expected_recall(width: int, bands: int, bits: int, threshold: float) -> float:
    """The chance that a pair of SimHash codes at cosine `threshold` agrees in at least one band."""
    p = math.acos(min(1.0, threshold)) / math.pi
    total = 0.0
    for k in range(bits + 1):
        miss_one = 1 - (math.comb(bits - k, width) / math.comb(bits, width) if bits - k >= width else 0.0)
        total += math.comb(bits, k) * p ** k * (1 - p) ** (bits - k) * (1 - miss_one ** bands)
    return total


def band_plan(samples: int, threshold: float, bits: int) -> BandPlan:
    """The band width for `samples` codes and as many bands as RECALL at `threshold` needs (at most
    MAX_BANDS: `recall_at` then says what is expected, and the stage's stats carry it)."""
    width = min(MAX_WIDTH, bits, max(MIN_WIDTH, math.ceil(math.log2(max(samples, 1) / GROUP))))
    lo, hi = 1, MAX_BANDS             # the fewest bands that reach RECALL: recall grows with bands
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if expected_recall(width, mid, bits, threshold) < RECALL else (lo, mid)
    return BandPlan(width, lo, bits)


def band_values(codes: np.ndarray, plan: BandPlan) -> np.ndarray:
    """(n, bits/8) uint8 -> (bands, n) uint64: each band's bits packed into one integer."""
    bits = np.unpackbits(codes, axis=1)                                   # (n, bits)
    out = np.zeros((plan.bands, len(codes)), np.uint64)
    for b, pos in enumerate(plan.positions):
        packed = np.packbits(bits[:, pos], axis=1)                        # (n, ceil(width / 8))
        padded = np.zeros((len(codes), 8), np.uint8)
        padded[:, :packed.shape[1]] = packed
        out[b] = padded.view("<u8")[:, 0]
    return out


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads a uint64 evenly (for bucket numbers)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def runs(*columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of rows sorted by `columns`: the start and length of each run of equal values."""
    n = len(columns[0])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    change = np.zeros(n, bool)
    change[0] = True
    for c in columns:
        change[1:] |= c[1:] != c[:-1]
    starts = np.flatnonzero(change)
    return starts, np.diff(np.append(starts, n))


def close_in_groups(codes: np.ndarray, means: np.ndarray, starts: np.ndarray, lengths: np.ndarray, radius: int,
                    colour_tol: float, block: int = 1024):
    """Row pairs (i, j), i < j, in one group (rows start..start+length, sorted) whose codes are within
    `radius` bits and whose mean colours agree. Groups of one size are done together; a group larger
    than SMALL_GROUP a block of rows at a time, in full: never cut short (a cut silently loses
    recall). Yields arrays (i, j)."""
    words = codes.view("<u8") if codes.shape[1] % 8 == 0 else codes
    for size in np.unique(lengths[lengths > 1]):
        group_starts = starts[lengths == size]
        if size > SMALL_GROUP:
            for s in group_starts:
                for a, b in close_pairs_block(words[s:s + size], means[s:s + size], radius, colour_tol, block):
                    yield s + a, s + b
            continue
        ia, ib = np.triu_indices(int(size), 1)
        per = max(1, PAIR_CHUNK // len(ia))
        for lo in range(0, len(group_starts), per):
            g = group_starts[lo:lo + per, None]
            i, j = (g + ia).ravel(), (g + ib).ravel()
            ham = np.bitwise_count(words[i] ^ words[j]).sum(-1)
            keep = (ham <= radius) & (np.abs(means[i] - means[j]).max(-1) <= colour_tol)
            if keep.any():
                yield i[keep], j[keep]


def close_pairs_block(words: np.ndarray, means: np.ndarray, radius: int, colour_tol: float, block: int = 1024):
    """(a, b) arrays, a < b, within one large group: XOR and popcount a block of rows at a time
    (memory: block x group x bits/8), so a large group costs time, not memory."""
    mv = np.asarray(means, np.float32)
    for lo in range(0, len(words), block):
        hi = min(len(words), lo + block)
        ham = np.bitwise_count(words[lo:hi, None, :] ^ words[None, lo:, :]).sum(-1)        # (rows, lo..n)
        near = (ham <= radius) & (np.abs(mv[lo:hi, None] - mv[None, lo:]).max(-1) <= colour_tol)
        a, b = np.nonzero(near)
        upper = a < b          # column b is row lo + b: the pair once, never a row with itself
        if upper.any():
            yield lo + a[upper], lo + b[upper]


def collapse_copies(codes: np.ndarray, means: np.ndarray, starts: np.ndarray, lengths: np.ndarray):
    """Exact copies out of groups larger than SMALL_GROUP before they are searched: a placeholder
    image repeated 10^4 times shares every band value, and comparing its copies pairwise is 5*10^7
    pairs a band. Rows of one group with the same code and mean colour become one representative
    (the group's first such row) and each other copy is paired with it: linear in the copies.
    -> (rows, starts, lengths) of the groups left to search, as indices into the original rows
    (ascending within each group), and the copies' pairs (rep, copy), rep < copy."""
    big = lengths > SMALL_GROUP
    keep_rows = [np.arange(s, s + n) for s, n in zip(starts[~big], lengths[~big])]
    keep_lengths = list(lengths[~big])
    rep_i, copy_j = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for s, n in zip(starts[big], lengths[big]):
        row_bytes = np.concatenate([codes[s:s + n], np.ascontiguousarray(means[s:s + n], np.float32).view(np.uint8)], 1)
        as_void = np.ascontiguousarray(row_bytes).view(np.dtype((np.void, row_bytes.shape[1]))).ravel()
        _, first, inverse = np.unique(as_void, return_index=True, return_inverse=True)
        rep = first[inverse.ravel()]                       # each row's representative, local
        copies = np.flatnonzero(rep != np.arange(n))
        rep_i.append(s + rep[copies])
        copy_j.append(s + copies)
        keep_rows.append(s + np.sort(first))
        keep_lengths.append(len(first))
    rows = np.concatenate(keep_rows) if keep_rows else np.zeros(0, np.int64)
    new_lengths = np.asarray(keep_lengths, np.int64)
    new_starts = np.concatenate([[0], np.cumsum(new_lengths)[:-1]]).astype(np.int64) if len(new_lengths) else new_lengths
    return rows, new_starts, new_lengths, np.concatenate(rep_i), np.concatenate(copy_j)
