"""Pictures with the shapes web data has and the demo's square scenes lack, for tests and benchmarks.

`mixed_aspect`: distinct pictures in six aspect ratios (4:3, 3:4, 16:9, 9:16, 3:2, 2:3), a share of
them product-like (one flat background colour, one small object, as shop photos are), the rest
photo-like (a gradient and several shapes over the whole frame). Each is accepted only if the
near-duplicate descriptor (stages.dedup.imagehash) finds it clearly unlike every picture before it *as an
original*, so any of them dropped as a duplicate after ingest was dropped for what ingest did to it.
`product_shots`: distinct products photographed alike (Fashion-MNIST's garments, dark on white) and
re-hosted copies of some, for the within-data rule: the copies are one with their originals, the
products are not one with each other.
Written like the demo's site: files under `www/img/`, URLs with the `{DEMO_SERVER}` placeholder.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from ..dedup.imagehash import describe
from .synthetic import SERVER_PLACEHOLDER

ASPECTS = ((4, 3), (3, 4), (16, 9), (9, 16), (3, 2), (2, 3))
DISTINCT_BELOW = 0.9        # cosine between originals' descriptors (dedup calls 0.97 a near copy)
COLOUR_TOL = 12.0           # dedup's colour check: pictures further apart in mean colour never match


def _size(rng, aspect) -> tuple[int, int]:
    long_side = int(rng.integers(240, 400))
    a, b = aspect
    return (long_side, round(long_side * b / a)) if a >= b else (round(long_side * a / b), long_side)


def _polygon(rng, cx, cy, r) -> list[tuple[float, float]]:
    k = int(rng.integers(3, 10))
    angles = np.sort(rng.uniform(0, 2 * np.pi, k))
    radii = r * rng.uniform(0.55, 1.0, k)
    return [(cx + rr * np.cos(a), cy + rr * np.sin(a)) for a, rr in zip(angles, radii)]


def product(rng, size) -> Image.Image:
    """One small object on one flat colour (white half the time)."""
    w, h = size
    bg = (255, 255, 255) if rng.random() < 0.5 else tuple(int(v) for v in [rng.integers(215, 250)] * 3)
    img = Image.new("RGB", size, bg)
    draw = ImageDraw.Draw(img)
    r = min(w, h) * rng.uniform(0.12, 0.3)
    cx, cy = w * rng.uniform(0.3, 0.7), h * rng.uniform(0.3, 0.7)
    colour = tuple(int(v) for v in rng.integers(0, 200, 3))
    if rng.random() < 0.3:
        draw.ellipse((cx - r, cy - r * rng.uniform(0.4, 1.0), cx + r, cy + r), fill=colour)
    else:
        draw.polygon(_polygon(rng, cx, cy, r), fill=colour)
    return img


def photo(rng, size) -> Image.Image:
    """A gradient between two colours and several shapes over the whole frame, with sensor noise."""
    w, h = size
    a, b = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = np.clip(np.add.outer(np.linspace(0, 1, h) * rng.uniform(-1, 1), np.linspace(0, 1, w) * rng.uniform(-1, 1)) + 0.5, 0, 1)
    arr = a[None, None] * (1 - t[..., None]) + b[None, None] * t[..., None]
    img = Image.fromarray(arr.astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 7))):
        r = min(w, h) * rng.uniform(0.1, 0.35)
        draw.polygon(_polygon(rng, w * rng.uniform(0, 1), h * rng.uniform(0, 1), r),
                     fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    noisy = np.asarray(img, np.float32) + rng.normal(0, 5, (h, w, 1))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def _distinct(vec, mean, kept_vecs, kept_means) -> bool:
    if not kept_vecs:
        return True
    cos = np.stack(kept_vecs) @ vec
    colour_close = np.abs(np.stack(kept_means) - mean).max(1) <= COLOUR_TOL
    return not bool(np.any((cos >= DISTINCT_BELOW) & colour_close))


def mixed_aspect(out_dir: Path, n: int, seed: int, product_fraction: float = 0.4, quality: int = 90) -> list[dict]:
    """Write `n` distinct pictures under out_dir/www/img; -> the URL list's rows (url with the
    server placeholder, caption, kind, width, height)."""
    rng = np.random.default_rng(seed)
    (out_dir / "www" / "img").mkdir(parents=True, exist_ok=True)
    kinds = ["product" if i < round(n * product_fraction) else "photo" for i in range(n)]
    rng.shuffle(kinds)
    rows, vecs, means = [], [], []
    for i, kind in enumerate(kinds):
        aspect = ASPECTS[i % len(ASPECTS)]
        while True:   # redraw until clearly unlike every earlier picture (a few redraws at most)
            img = (product if kind == "product" else photo)(rng, _size(rng, aspect))
            vec, mean = describe(np.asarray(img))
            if _distinct(vec, mean, vecs, means):
                break
        vecs.append(vec)
        means.append(mean)
        name = f"{kind}{i:05d}.jpg"
        img.save(out_dir / "www" / "img" / name, "JPEG", quality=quality)
        rows.append({"url": f"{SERVER_PLACEHOLDER}/img/{name}", "caption": f"{kind} picture number {i} of {n}",
                     "kind": kind, "width": img.size[0], "height": img.size[1]})
    return rows


def product_shot(garment: np.ndarray, side: int) -> Image.Image:
    """A Fashion-MNIST garment (28x28 grey, light on black) as a shop shows it: dark on white, `side` px."""
    return Image.fromarray(255 - garment).resize((side, side), Image.BICUBIC).convert("RGB")


def product_shots(out_dir: Path, n: int, copies: int, seed: int, side: int = 320) -> list[dict]:
    """`n` distinct products photographed alike (Fashion-MNIST's test images, each another garment,
    dark on a white ground as a shop shows them; Debian's dataset-fashion-mnist), then `copies` of
    them re-hosted as another site serves a picture (resized 0.6-2x, a JPEG of quality 60-90), under
    out_dir/www/img; -> the URL list's rows (url with the server placeholder, caption, kind "product"
    or "copy", copy_of: the row it copies). Thumbnails of 16x16 join many such products (they differ
    in shapes a thumbnail blurs), where a copy differs only in what re-hosting did."""
    import io

    from trainers.evaluation.datasets import fashion_mnist_images

    rng = np.random.default_rng(seed)
    images = fashion_mnist_images()
    (out_dir / "www" / "img").mkdir(parents=True, exist_ok=True)
    rows, seen, shots = [], set(), []
    for k in rng.permutation(len(images)):
        if len(rows) == n:
            break
        if images[k].tobytes() in seen:        # the split holds a few images twice: copies, not distinct
            continue
        seen.add(images[k].tobytes())
        img = product_shot(images[k], side)
        name = f"product{len(rows):05d}.png"
        img.save(out_dir / "www" / "img" / name)
        shots.append(img)
        rows.append({"url": f"{SERVER_PLACEHOLDER}/img/{name}", "caption": f"product number {len(rows)} of the shop",
                     "kind": "product", "copy_of": None})
    for c, i in enumerate(rng.choice(len(shots), copies, replace=False)):
        s = rng.uniform(0.6, 2.0)
        img = shots[i].resize((round(side * s), round(side * s)), Image.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=int(rng.integers(60, 91)))
        name = f"copy{c:05d}.jpg"
        (out_dir / "www" / "img" / name).write_bytes(buf.getvalue())
        rows.append({"url": f"{SERVER_PLACEHOLDER}/img/{name}", "caption": f"the shop's product {i} on another site",
                     "kind": "copy", "copy_of": int(i)})
    return rows
