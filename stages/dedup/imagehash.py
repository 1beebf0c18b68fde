"""Image descriptors for near-duplicate detection, with no model weights.

A descriptor is a 16x16 colour thumbnail of the image (uniform black padding trimmed first),
lightly blurred, less its per-channel mean, L2-normalised: 768 floats whose cosine stays high under
resizing, re-encoding and small rotations. The per-channel mean (the colour the subtraction
removed) is kept beside it for a colour check, since simple scenes with the same layout differ
mainly in colour. For search at scale each descriptor also gets a SimHash: the sign bits of fixed
random projections, whose Hamming distance tracks the angle between descriptors (faiss binary
indexes); candidates found that way are re-ranked by exact cosine.

Two distinct pictures of one kind (garments photographed alike on white, icons of one set) share
their 16x16 thumbnails: Fashion-MNIST's test images, each a different product, were joined at
cosine 0.97 for 43 % of them. So two training images joined by the thumbnail are compared once more
by `detail`, a 24x24 grey thumbnail (blurred, less its mean, L2-normalised: 576 floats), which
tells their shapes apart where a re-hosted copy (resized, re-encoded) stays close.

Crops move everything, so the *reference* side (evaluation images) is described at several crops
too (`crops`): a candidate cut from a reference image lands near one of them.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from PIL import Image, ImageFilter

from infra.media import PAD_TOLERANCE, decode

SIDE = 16
DIM = SIDE * SIDE * 3


def to_rgb_array(image) -> np.ndarray:
    """bytes | PIL.Image | array (H, W[, C]) -> uint8 RGB (H, W, 3)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        image = decode(image)   # the untrusted-input policy: evaluation sets come through here
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    return arr[..., :3].astype(np.uint8)


def trim_border(arr: np.ndarray, level: float = 12.0) -> np.ndarray:
    """Remove near-black edge bands (img2dataset's 'border' resize pads with black).

    Only black bands are trimmed: a plain background touching an edge is content, not padding.
    """
    # a band's outermost line is an edge line: where none of the four is black there is nothing to
    # trim, the same answer at a hundredth of the cost (the whole picture scanned took 1.9 ms at
    # 256 px, as much as the rest of `describe`)
    if all(float(line.max()) > level for line in (arr[0], arr[-1], arr[:, 0], arr[:, -1])):
        return arr
    g = arr.astype(np.float32).max(-1)
    h, w = g.shape
    rows = np.where(g.max(1) > level)[0]
    cols = np.where(g.max(0) > level)[0]
    if len(rows) < h // 4 or len(cols) < w // 4:
        return arr  # (almost) all black: nothing to trim to
    return arr[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]


def trim_flat_bars(arr: np.ndarray, tol: float = PAD_TOLERANCE, level: float = 12.0) -> np.ndarray | None:
    """The picture inside bars of one flat colour other than black (a white frame, a page's coloured
    canvas around a re-hosted image) -> the array cropped to it, or None where there are no such bars.
    Searched as a second query against the evaluation sets only (`describe._describe_task`): a copy
    in a white 4:3 frame matched 0 of 2,000 times as a whole (benchmarks/eval_recall.py). A row or
    column is a bar when 98 % of it is within `tol` of the edges' colour: JPEG's noise on a saturated
    frame, encoded twice (the site, then ingest), reaches 12-16 a channel."""
    a = arr.astype(np.int16)
    h, w = a.shape[:2]
    colour = np.median(np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]]), axis=0)
    if colour.max() <= level:
        return None                      # black: trim_border's
    # every image of a partition comes through here: where no edge line is a bar (most pictures) there
    # is none inside either, told from the edges alone (0.1 ms, where the whole image is ~4 ms at 256 px)
    if not any((np.abs(edge - colour).max(-1) <= tol).mean() >= 0.98 for edge in (a[0], a[-1], a[:, 0], a[:, -1])):
        return None
    flat = np.abs(a - colour).max(-1) <= tol
    rows, cols = np.flatnonzero(flat.mean(1) < 0.98), np.flatnonzero(flat.mean(0) < 0.98)
    if not len(rows) or not len(cols):
        return None                      # one flat colour: nothing inside
    top, bottom, left, right = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    # a frame holds a picture; an object on a plain background would pass for one (the demo's small
    # red square on a lavender ground matched an evaluation image's corner), so the picture inside
    # must span half of each side at least
    if max(top, h - bottom, left, w - right) < 2 or 2 * (bottom - top) < h or 2 * (right - left) < w:
        return None
    # the picture's first line beside a bar is a blend of the two (the resize's and JPEG's filters): a
    # copy framed at 256 px matched its original at cosine 0.991 (detail 0.989) with it, 0.999 without
    top, bottom = top + (top > 0), bottom - (bottom < h)
    left, right = left + (left > 0), right - (right < w)
    return arr[top:bottom, left:right]


def describe(image) -> tuple[np.ndarray, np.ndarray]:
    """-> (descriptor (DIM,) float32 unit norm, mean colour (3,) float32 in 0..255)."""
    arr = trim_border(to_rgb_array(image))
    small = Image.fromarray(arr).resize((SIDE, SIDE), Image.BOX).filter(ImageFilter.GaussianBlur(0.6))
    x = np.asarray(small).astype(np.float32)
    mean = x.mean((0, 1))
    v = (x - mean).ravel()
    return (v / (np.linalg.norm(v) + 1e-6)).astype(np.float32), mean.astype(np.float32)


DETAIL_SIDE = 24
DETAIL_DIM = DETAIL_SIDE * DETAIL_SIDE


def detail(image) -> np.ndarray:
    """-> (DETAIL_DIM,) float32 unit norm: the picture's grey 24x24 thumbnail (black bars trimmed as
    `describe` trims them), lightly blurred, less its mean. Compared only between two pictures the
    16x16 descriptor already joined (the within-data verification)."""
    arr = trim_border(to_rgb_array(image))
    small = Image.fromarray(arr).convert("L").resize((DETAIL_SIDE, DETAIL_SIDE), Image.BOX)
    x = np.asarray(small.filter(ImageFilter.GaussianBlur(0.6)), np.float32)
    v = (x - x.mean()).ravel()
    return (v / (np.linalg.norm(v) + 1e-6)).astype(np.float32)


def framed_descriptors(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The thumbnail descriptor, mean colour and detail of the picture inside bars of one flat colour
    (`trim_flat_bars`), None where it has none: what the evaluation search and removals search
    besides the whole."""
    inside = trim_flat_bars(arr)
    if inside is None:
        return None
    return (*describe(inside), detail(inside))


def crops(image, scales=(0.05, 0.10, 0.15)) -> list[np.ndarray]:
    """The image plus crops that each remove up to `scale` of a side: centred and corner-anchored
    (aspect kept), and from one side only (aspect changed). 1 + 3 x 9 = 28 references."""
    arr = trim_border(to_rgb_array(image))
    h, w = arr.shape[:2]
    out = [arr]
    for s in scales:
        dh, dw = int(round(h * s)), int(round(w * s))
        out.append(arr[dh:h - dh, dw:w - dw])
        for y0, x0 in ((0, 0), (0, 2 * dw), (2 * dh, 0), (2 * dh, 2 * dw)):
            out.append(arr[y0:y0 + h - 2 * dh, x0:x0 + w - 2 * dw])
        out += [arr[2 * dh:], arr[:h - 2 * dh], arr[:, 2 * dw:], arr[:, :w - 2 * dw]]
    return out


@lru_cache(maxsize=8)
def _projection(dim: int, bits: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((dim, bits)).astype(np.float32)


def simhash(vectors: np.ndarray, bits: int = 256, seed: int = 0) -> np.ndarray:
    """(n, dim) float -> (n, bits / 8) uint8: sign bits of fixed random projections."""
    proj = _projection(vectors.shape[1], bits, seed)
    return np.packbits(vectors @ proj > 0, axis=1)
