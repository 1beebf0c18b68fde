"""Dedup within the data on real images: which distinct images does `within_threshold` join?

`dedup_within.py` measures recall on random codes; what a threshold costs on real data's shapes is
the other side: images that are not copies of each other but whose descriptors are as close. Here
the data is Debian's openclipart-svg (~8,100 clip-art SVGs), rendered as the openclipart source
renders them (`render_png`, 128 px on white); or, with `--data products`, 4,000 distinct garments
photographed alike (Fashion-MNIST's test images, dark on white at 400 px, as a shop shows them: each
a different product). Resized by img2dataset's `Resizer` as ingest does (`--image-size`, `border`)
and described as the dedup stage describes a picture (`eval_recall.as_dedup_sees`,
`imagehash.describe`, and `imagehash.detail` for the verification).

Pairs: every pair the stage's near-duplicate rule joins (exact cosine >= threshold, mean colours
within `colour_tol`; "with detail": and the detail descriptors at cosine >=
`within_detail_threshold`, the stage's rule since v4s21), by brute force (the stage's LSH finds >= 0.98 of the pairs at the threshold).
A pair of the same file (the package links some drawings into two folders) or the same pixels is a
copy, which the stage drops anyway (`exact_duplicate` by pixels); every other pair is two distinct
drawings. For each threshold: the samples the near pairs between distinct drawings drop (each
cluster keeps one), all and outside `shapes/stars` (hundreds of generated star polygons that look
alike at 128 px), and 16 of those pairs side by side in a picture to judge by eye. The other side
of a threshold: `--copies` drawings re-hosted (resized 0.6-2x, JPEG of quality 40-90), through the
same resize, and the share of them still at each threshold to their original (a drawing that
renders blank has no descriptor to compare, and is left out: blank copies are exact duplicates).

    python benchmarks/dedup_real.py [--data openclipart|products] [--image-size 128] [--label NAME]
Results: benchmarks/results/dedup_real.json (runs[label]), dedup_real-<data>-pairs.png.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from infra import offline  # noqa: E402

offline.apply()

import numpy as np  # noqa: E402

from benchmarks._common import RESULTS, code, merge_run  # noqa: E402

ROOT = Path("/usr/share/openclipart/svg")
THRESHOLDS = (0.97, 0.98, 0.99, 0.995)


def _render(rel: str):
    from stages.source.openclipart import render_png

    try:
        return rel, render_png((ROOT / rel).read_bytes(), 128)
    except Exception:  # noqa: BLE001 - the source stage drops these with their reason; here they are left out
        return rel, None


def _product(k: int, images):
    """Garment `k` of `images` (Fashion-MNIST's test split) as a shop shows it: dark on white, 400 px."""
    from stages.source.web_shapes import product_shot

    out = io.BytesIO()
    product_shot(images[k], 400).save(out, "PNG")
    return f"fashion-mnist/t10k/{k:05d}", out.getvalue()


def _rehosted(png: bytes, rng) -> bytes:
    """A drawing as another site serves it: resized 0.6-2x, a JPEG of quality 40-90."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    s = rng.uniform(0.6, 2.0)
    img = img.resize((max(8, round(img.width * s)), max(8, round(img.height * s))), Image.BICUBIC)
    out = io.BytesIO()
    img.save(out, "JPEG", quality=int(rng.integers(40, 91)))
    return out.getvalue()


def dropped_by(edges: np.ndarray, n: int) -> int:
    """Samples a set of pairs drops: each connected cluster keeps one."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    if not len(edges):
        return 0
    graph = coo_matrix((np.ones(len(edges)), (edges[:, 0], edges[:, 1])), shape=(n, n))
    return n - connected_components(graph, directed=False)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", choices=("openclipart", "products"), default="openclipart")
    ap.add_argument("--image-size", type=int, default=128, help="stages.ingest.image_size (configs/openclipart.yaml: 128)")
    ap.add_argument("--products", type=int, default=4000, help="--data products: how many garments")
    ap.add_argument("--copies", type=int, default=400)
    ap.add_argument("--label", default="default")
    args = ap.parse_args()

    from PIL import Image

    from eval_recall import as_dedup_sees
    from stages.dedup.config import DedupConfig
    from stages.dedup.imagehash import describe, detail, to_rgb_array

    cfg = DedupConfig()
    t0 = time.time()
    if args.data == "products":
        from trainers.evaluation.datasets import fashion_mnist_images

        images = fashion_mnist_images()
        files = list(range(args.products))
        got = [_product(k, images) for k in files]
        same = np.array([name for name, _ in got])
    else:
        files = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.svg"))
        with Pool(os.cpu_count()) as pool:
            got = [g for g in pool.map(_render, files, chunksize=32) if g[1] is not None]
        same = np.array([os.path.realpath(ROOT / rel) for rel, _ in got])
    rendered = time.time() - t0
    seen = [to_rgb_array(s) for s in as_dedup_sees([png for _, png in got], args.image_size)]
    vecs, means = map(np.stack, zip(*(describe(s) for s in seen)))
    details = np.stack([detail(s) for s in seen])
    n = len(got)
    print(f"{len(files)} {args.data}, {n} rendered in {rendered:.0f} s and described", flush=True)
    pixels = np.array([hashlib.sha256(np.asarray(s).tobytes()).hexdigest() for s in seen])
    star = np.array(["shapes/stars/" in rel for rel, _ in got])
    sims = vecs @ vecs.T
    close = np.argwhere(np.triu(sims >= min(THRESHOLDS), 1))
    colour = np.abs(means[close[:, 0]] - means[close[:, 1]]).max(-1) <= cfg.colour_tol
    close = close[colour]
    cos = sims[close[:, 0], close[:, 1]]
    told = np.einsum("ij,ij->i", details[close[:, 0]], details[close[:, 1]]) < cfg.within_detail_threshold
    copy = (same[close[:, 0]] == same[close[:, 1]]) | (pixels[close[:, 0]] == pixels[close[:, 1]])
    stars = star[close[:, 0]] | star[close[:, 1]]
    result = {"code": code(), "data": args.data, "items": len(files), "rendered": n, "image_size": args.image_size,
              "colour_tol": cfg.colour_tol, "within_threshold_default": cfg.within_threshold,
              "within_detail_threshold": cfg.within_detail_threshold, "thresholds": {}}
    rng = np.random.default_rng(0)
    picked = [k for k in rng.permutation(n) if np.linalg.norm(vecs[k]) > 0.5][:args.copies]
    copies = [to_rgb_array(c) for c in as_dedup_sees([_rehosted(got[k][1], rng) for k in picked], args.image_size)]
    to_original = np.array([describe(c)[0] @ vecs[k] for c, k in zip(copies, picked)])
    detail_kept = np.array([detail(c) @ details[k] for c, k in zip(copies, picked)]) >= cfg.within_detail_threshold
    result["copies"] = {"n": len(picked), "cosine_q05": round(float(np.quantile(to_original, 0.05)), 4),
                        "cosine_median": round(float(np.median(to_original)), 4),
                        "detail_kept": round(float(np.mean(detail_kept)), 4)}
    for t in THRESHOLDS:
        at = cos >= t
        distinct = close[at & ~copy]
        row = {"pairs": int(at.sum()), "copy_pairs": int((at & copy).sum()), "distinct_pairs": len(distinct),
               "dropped_by_distinct_pairs": int(dropped_by(distinct, n)),
               "dropped_by_distinct_pairs_outside_stars": int(dropped_by(close[at & ~copy & ~stars], n)),
               "rehosted_copies_found": round(float(np.mean(to_original >= t)), 4),
               "with_detail": {"distinct_pairs": int((at & ~copy & ~told).sum()),
                               "dropped_by_distinct_pairs": int(dropped_by(close[at & ~copy & ~told], n)),
                               "dropped_by_distinct_pairs_outside_stars": int(dropped_by(close[at & ~copy & ~told & ~stars], n)),
                               "rehosted_copies_found": round(float(np.mean((to_original >= t) & detail_kept)), 4)}}
        result["thresholds"][str(t)] = row
        d = row["with_detail"]
        print(f"within_threshold {t}: {row['pairs']} pairs ({row['copy_pairs']} of copies); the pairs of distinct "
              f"{args.data} drop {row['dropped_by_distinct_pairs']} of {n} samples "
              f"({row['dropped_by_distinct_pairs'] / n:.1%}), {row['dropped_by_distinct_pairs_outside_stars']} "
              f"outside shapes/stars ({row['dropped_by_distinct_pairs_outside_stars'] / n:.1%}); re-hosted copies "
              f"at the threshold: {row['rehosted_copies_found']:.1%} of {len(picked)}", flush=True)
        print(f"  with the detail check at {cfg.within_detail_threshold}: drop {d['dropped_by_distinct_pairs']} "
              f"({d['dropped_by_distinct_pairs'] / n:.1%}), {d['dropped_by_distinct_pairs_outside_stars']} outside "
              f"shapes/stars ({d['dropped_by_distinct_pairs_outside_stars'] / n:.1%}); re-hosted copies found "
              f"{d['rehosted_copies_found']:.1%}", flush=True)
    # what the default rule still joins, outside the stars, to judge by eye
    shown = close[(cos >= cfg.within_threshold) & ~copy & ~stars & ~told]
    shown = shown[np.random.default_rng(0).permutation(len(shown))[:16]]
    side = 96
    sheet = Image.new("RGB", (2 * side + 8, side * max(1, len(shown))), (128, 128, 128))
    result["shown"] = []
    for r, (i, j) in enumerate(shown):
        result["shown"].append([got[i][0], got[j][0], round(float(sims[i, j]), 4)])
        for c, k in enumerate((i, j)):
            im = Image.open(io.BytesIO(got[k][1])).convert("RGB")
            im.thumbnail((side, side))
            sheet.paste(im, (c * (side + 8), r * side))
    sheet.save(RESULTS / f"dedup_real-{args.data}-pairs.png", optimize=True)
    print(f"{len(shown)} pairs the default rule still joins outside the stars: {RESULTS / f'dedup_real-{args.data}-pairs.png'}")
    merge_run("dedup_real", args.label, result)


if __name__ == "__main__":
    main()
