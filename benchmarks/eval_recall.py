"""Decontamination on a real evaluation set of 50,000 images: does dedup find the web's copies of them?

`eval_index.py` measured the evaluation index at this size on random descriptors (recall 0.78 there,
random codes having no structure for the inverted file to follow). Here the set is real:
Fashion-MNIST's training images (Debian's dataset-fashion-mnist), `--images` of them written as
PNGs to a Parquet evaluation set and indexed by the stage's own `build_reference` (28 crops an
image; past 10^6 references an inverted file, searched as the stage searches it: `neardup.NPROBE`
lists, 16 until the first run of this benchmark, 64 since).

Queries: `--queries` of the set's images as a crawl finds them: re-hosted larger (4x, bicubic) as
a JPEG of quality 85, in these variants, then resized by img2dataset's own `Resizer` as ingest
does (`--image-size`, `border`) and seen as the dedup stage sees a picture (`dataplane.pictures`:
decoded, the border's bars taken off):
- copy: the whole image;
- crop10: 10 % cut off one side (the aspect changes);
- centre5: 5 % cut off each side;
- white43: the image in a 4:3 white frame (a product page's canvas). The stage searches a picture
  inside bars of one flat colour a second time without them (`describe.framed_query`); here that
  leaves the black background of a Fashion-MNIST image with the frame's blended edge around it.
Negatives: as many images of Fashion-MNIST's test split (not in the set), as `copy`.

For each variant: dropped (the stage's index finds a match at `eval_threshold` within `colour_tol`:
the sample is dropped as an evaluation duplicate, whichever image it matched); found (the match is
one of the query's own reference's crops) with the stage's index and with an exact Hamming index over
the same codes (what the inverted file costs); and the best cosine to its own reference's 28 crops by
brute force (what the descriptor allows). For negatives: how many the stage would drop as evaluation
duplicates, and of those how many are near copies in the set's own pixels (Fashion-MNIST's test
split repeats some training images: a correlation of the 28x28 pixels >= 0.95 counts as one); beside
them the set's `alike` share, which the stage measures when it indexes a set and warns of
(`stages/dedup/stage.py::_alike`).

    python benchmarks/eval_recall.py [--images 50000] [--queries 2000] [--label NAME]
Results: benchmarks/results/eval_recall.json (runs[label]).
"""
from __future__ import annotations

import argparse
import gzip
import io
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra import offline  # noqa: E402

offline.apply()

import numpy as np  # noqa: E402

from benchmarks._common import code, merge_run  # noqa: E402

FMNIST = Path("/usr/share/datasets/fashion-mnist")
VARIANTS = ("copy", "crop10", "centre5", "white43")


def idx_images(name: str) -> np.ndarray:
    raw = gzip.open(FMNIST / name).read()
    return np.frombuffer(raw, np.uint8, offset=16).reshape(-1, 28, 28)


def web_copy(arr: np.ndarray, variant: str) -> bytes:
    """A 28x28 image as a site re-hosts it: 4x larger, `variant`'s cut or frame, a JPEG."""
    from PIL import Image

    img = Image.fromarray(arr).convert("RGB").resize((112, 112), Image.BICUBIC)
    w, h = img.size
    if variant == "crop10":
        img = img.crop((0, 0, w - round(0.10 * w), h))
    elif variant == "centre5":
        d = round(0.05 * w)
        img = img.crop((d, d, w - d, h - d))
    elif variant == "white43":
        canvas = Image.new("RGB", (w * 4 // 3, h), (255, 255, 255))
        canvas.paste(img, ((canvas.width - w) // 2, 0))
        img = canvas
    out = io.BytesIO()
    img.save(out, "JPEG", quality=85)
    return out.getvalue()


def as_dedup_sees(datas: list[bytes], image_size: int) -> list:
    """Ingest's resize (img2dataset's Resizer, `border`), then the dedup stage's picture of it."""
    import pyarrow as pa
    from img2dataset.resizer import Resizer

    from stages.dataplane import pictures

    resize = Resizer(image_size=image_size, resize_mode="border", resize_only_if_bigger=False, encode_format="jpg")
    stored, widths, heights = [], [], []
    for data in datas:
        img, _, _, ow, oh, err = resize(io.BytesIO(data))
        assert err is None, err
        stored.append(img)
        widths.append(ow)
        heights.append(oh)
    return pictures(pa.table({"width": widths, "height": heights}), stored)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=50_000)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--image-size", type=int, default=256, help="stages.ingest.image_size (default 256)")
    ap.add_argument("--label", default="default")
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from stages.dedup.config import DedupConfig
    from stages.dedup.eval_sets import EvalSetConfig, alike_share, build_reference
    from stages.dedup.describe import best_matches, framed_query
    from stages.dedup.imagehash import describe, to_rgb_array
    from stages.dedup.neardup import NearDupIndex

    cfg = DedupConfig()
    train, test = idx_images("train-images-idx3-ubyte.gz"), idx_images("t10k-images-idx3-ubyte.gz")
    refs = train[:args.images]
    rng = np.random.default_rng(0)
    pick = np.sort(rng.choice(len(refs), args.queries, replace=False))
    negatives = np.sort(rng.choice(len(test), args.queries, replace=False))
    result: dict = {"code": code(), "images": args.images, "queries": args.queries, "image_size": args.image_size,
                    "eval_threshold": cfg.eval_threshold, "colour_tol": cfg.colour_tol}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        pngs = []
        for arr in refs:
            out = io.BytesIO()
            Image.fromarray(arr).save(out, "PNG")
            pngs.append(out.getvalue())
        path = Path(tmp) / "fmnist.parquet"
        pq.write_table(pa.table({"id": [f"train{i:05d}" for i in range(len(refs))], "image": pngs}), path)
        es = EvalSetConfig(name="fmnist", kind="parquet", path=str(path), image_col="image", id_col="id")
        params = {"bits": cfg.bits, "colour_tol": cfg.colour_tol}
        index_path, stats = build_reference(es, None, Path(tmp) / "cache", params, log=lambda m: None)
        result["index_s"] = round(time.time() - t0, 1)
        t0 = time.time()
        stage_index = NearDupIndex.load(index_path)           # as the driver loads it for the stage
        result["load_s"] = round(time.time() - t0, 1)
    result["references"] = stats["references"]
    result["alike"] = alike_share(stats, cfg.eval_threshold)
    result["inverted_file"] = type(stage_index.index).__name__
    print(f"{args.images} Fashion-MNIST training images indexed: {stats['references']:,} references "
          f"({result['index_s']} s to describe, {result['load_s']} s to load; {result['inverted_file']})", flush=True)
    exact = NearDupIndex(cfg.bits, cfg.colour_tol, ivf_above=10**12).build(
        stage_index.ids, stage_index.vecs, stage_index.means, stage_index.codes)
    ref_of = np.array([int(i.split("train", 1)[1]) for i in np.unique(stage_index.ids)])
    assert (ref_of == np.arange(len(refs))).all()
    row_image = np.searchsorted(np.unique(stage_index.ids), stage_index.ids)   # reference row -> image

    def search(queries: list) -> tuple[np.ndarray, np.ndarray, list]:
        """The describe task's queries: each picture whole, and inside a frame of one flat colour."""
        arrs = [to_rgb_array(q) for q in queries]
        vecs, means = zip(*(describe(a) for a in arrs))
        framed = [(j, *f) for j, a in enumerate(arrs) if (f := framed_query(a)) is not None]
        return np.stack(vecs), np.stack(means), framed

    def matched(index, vecs, means, framed) -> tuple[np.ndarray, np.ndarray]:
        """-> (image of the match or -1, its cosine), the stage's rule: a match at eval_threshold."""
        _, ids, s = best_matches({"fmnist": index}, "hash", vecs, means, framed)
        image = np.array([int(i[len("train"):]) if i else -1 for i in ids])
        return np.where(s >= cfg.eval_threshold, image, -1), s

    rows = {}
    for variant in VARIANTS:
        t0 = time.time()
        seen = as_dedup_sees([web_copy(refs[j], variant) for j in pick], args.image_size)
        vecs, means, framed = search(seen)
        got_stage, _ = matched(stage_index, vecs, means, framed)
        t1 = time.time()
        got_exact, _ = matched(exact, vecs, means, framed)
        # the descriptor's own limit: the best cosine to the 28 crops of each query's reference
        own = np.array([(stage_index.vecs[row_image == j] @ v).max() for j, v in zip(pick, vecs)])
        colour_ok = np.array([(np.abs(stage_index.means[row_image == j] - m).max(-1) <= cfg.colour_tol).any()
                              for j, m in zip(pick, means)])
        reachable = (own >= cfg.eval_threshold) & colour_ok
        rows[variant] = {
            "dropped": int((got_stage >= 0).sum()), "found_stage_index": int((got_stage == pick).sum()), "found_exact_index": int((got_exact == pick).sum()),
            "reachable": int(reachable.sum()), "own_cosine_median": round(float(np.median(own)), 4),
            "own_cosine_p05": round(float(np.quantile(own, 0.05)), 4),
            "matched_another_image": int(((got_stage >= 0) & (got_stage != pick)).sum()),
            "stage_search_s": round(t1 - t0, 1)}
        r = rows[variant]
        print(f"{variant:8s} dropped {r['dropped']}/{args.queries}; found their own image {r['found_stage_index']} "
              f"with the stage's index, "
              f"{r['found_exact_index']} with an exact one, {r['reachable']} within the threshold of their "
              f"own reference (cosine median {r['own_cosine_median']}, 5th percentile {r['own_cosine_p05']}); "
              f"{r['matched_another_image']} matched another image", flush=True)
    seen = as_dedup_sees([web_copy(test[j], "copy") for j in negatives], args.image_size)
    vecs, means, framed = search(seen)
    got, sims = matched(stage_index, vecs, means, framed)
    flagged = np.flatnonzero(got >= 0)

    def corr(a: np.ndarray, b: np.ndarray) -> float:
        a, b = a.astype(np.float32).ravel() - a.mean(), b.astype(np.float32).ravel() - b.mean()
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-6))

    pixel = [corr(test[negatives[q]], refs[got[q]]) for q in flagged]
    copies = int(sum(c >= 0.95 for c in pixel))
    rows["negatives"] = {"flagged": len(flagged), "near_copies_in_pixels": copies,
                         "pixel_correlation_median": round(float(np.median(pixel)), 4) if pixel else None}
    print(f"negatives: {len(flagged)}/{args.queries} test-split images would be dropped as evaluation duplicates; "
          f"{copies} of them are near copies of their match in the 28x28 pixels (correlation >= 0.95), "
          f"median correlation {rows['negatives']['pixel_correlation_median']}; the set's images alike at the "
          f"threshold (what the stage warns of): {result['alike']:.2f}", flush=True)
    result["variants"] = rows
    merge_run("eval_recall", args.label, result)


if __name__ == "__main__":
    main()
