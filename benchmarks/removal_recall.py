"""Removals by image: how often a removed picture is found again after a trivial edit, and how often
another picture is taken for it.

    python benchmarks/removal_recall.py
Results: benchmarks/results/removal_recall.json

The pictures: distinct 240 x 180 views cut from ten of scikit-image's and scikit-learn's photos (up
to six of each, no two overlapping). Each is removed by image (`capline remove --list` with the JPEG, `remove.image_vectors`:
its views, as the removal records them), then comes back edited as a site would re-host it: cropped
5 % and 10 %, mirrored, in grey, turned 3 and -5 degrees, in a red frame, on a white 4:3 canvas, in
a grey frame after a 5 % crop; each edit as a JPEG (quality 85), then as ingest stores it (the long
side 256, JPEG 95), described as dedup's describe step describes a sample (the whole picture, and
the picture inside a flat frame) and matched as dedup's verdicts and `remove` match one
(`removals.near_copies_of`, the default thresholds). Recall per edit; false matches: each unedited
picture against every other picture's removal.

Then the cost of the match at scale: one partition's 10,000 samples against 200,000 removed
references (random unit descriptors; a copy of 100 of them among the samples), by Hamming candidates
(what a dedup verdict task does past `removals.ANN_ABOVE` references) and by comparing every
reference, seconds and the copies each finds.
"""
from __future__ import annotations

import io
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from PIL import Image, ImageOps  # noqa: E402

from benchmarks._common import code, write_results  # noqa: E402


def pictures(per_photo: int = 6, size=(240, 180)) -> list[Image.Image]:
    """Up to `per_photo` non-overlapping views of each of ten photos (the photos the machine has)."""
    import skimage.data as skd
    from sklearn.datasets import load_sample_images

    sources = [getattr(skd, name)() for name in ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field",
                                                 "immunohistochemistry", "camera", "coins")]
    sources += list(load_sample_images().images)
    out = []
    for a in sources:
        a = a[..., :3] if a.ndim == 3 else np.repeat(a[..., None], 3, -1)
        im = Image.fromarray(a.astype(np.uint8))
        w, h = size
        views = [im.crop((x, y, x + w, y + h)) for y in range(0, im.height - h + 1, h)
                 for x in range(0, im.width - w + 1, w)]
        out += views[:per_photo]
    return out


def edits(im: Image.Image) -> dict[str, Image.Image]:
    w, h = im.size
    crop = lambda f: im.crop((int(w * f), int(h * f), w - int(w * f), h - int(h * f)))  # noqa: E731
    return {"crop 5 %": crop(0.05), "crop 10 %": crop(0.10), "mirror": ImageOps.mirror(im),
            "grey": ImageOps.grayscale(im).convert("RGB"), "turned 3": im.rotate(3, resample=Image.BICUBIC),
            "turned -5": im.rotate(-5, resample=Image.BICUBIC),
            "red frame": ImageOps.expand(im, border=w // 12, fill=(200, 30, 30)),
            "white 4:3 canvas": ImageOps.pad(im, (w + w // 4, (w + w // 4) * 3 // 4), color=(255, 255, 255)),
            "grey frame, cropped 5 %": ImageOps.expand(crop(0.05), border=w // 20, fill=(128, 128, 128))}


def jpeg(im: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    im.convert("RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def as_ingested(im: Image.Image) -> bytes:
    """A re-hosted copy as the run stores it: the site's JPEG, then the long side 256 at quality 95."""
    im = Image.open(io.BytesIO(jpeg(im, 85))).convert("RGB")
    scale = 256 / max(im.size)
    return jpeg(im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))), Image.BICUBIC), 95)


def described(data: bytes) -> tuple[bytes, bytes, tuple | None]:
    """A sample's descriptors as dedup's describe step writes them (float16 bytes)."""
    from stages.dedup.imagehash import describe, detail, framed_descriptors, to_rgb_array, trim_border

    f16 = lambda v: v.astype(np.float16).tobytes()   # noqa: E731
    arr = to_rgb_array(data)
    core = trim_border(arr)
    framed = framed_descriptors(arr)
    return f16(describe(core)[0]), f16(detail(core)), (f16(framed[0]), f16(framed[2])) if framed else None


def at_scale(refs: int = 200_000, samples: int = 10_000) -> dict:
    from stages.shard.removals import near_copies, ref_index

    rng = np.random.default_rng(0)
    unit = lambda a: (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32)   # noqa: E731
    r, rd = unit(rng.standard_normal((refs, 768))), unit(rng.standard_normal((refs, 576)))
    picked = rng.choice(refs, 100, replace=False)
    q = unit(rng.standard_normal((samples, 768)))
    q[:100] = unit(r[picked] + 0.08 * unit(rng.standard_normal((100, 768))))
    qd = unit(rng.standard_normal((samples, 576)))
    qd[:100] = unit(rd[picked] + 0.05 * unit(rng.standard_normal((100, 576))))
    t0 = time.time()
    index = ref_index(r)
    built = time.time() - t0
    out = {"references": refs, "samples": samples, "index_build_s": round(built, 2)}
    for name, idx, refs_as in (("hamming_candidates", index, (r.astype(np.float16), rd.astype(np.float16))),
                               ("every_reference", None, (r, rd))):
        t0 = time.time()
        got = near_copies(q, qd, np.ones(samples, bool), refs_as[0], refs_as[1], np.ones(refs, bool),
                          np.full(refs, 0.97), np.full(refs, 0.99), index=idx)
        out[name] = {"seconds": round(time.time() - t0, 2),
                     "copies_found": sum(1 for i, h in enumerate(got[:100]) if h and h[0] == picked[i]),
                     "false": sum(1 for h in got[100:] if h)}
    return out


def main() -> None:
    import tempfile

    from pipeline import remove
    from stages.dedup.config import DedupConfig
    from stages.shard.removals import near_copies_of

    cfg = DedupConfig()
    pics = pictures()
    t0 = time.time()
    refs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, im in enumerate(pics):
            (Path(tmp) / f"{i}.jpg").write_bytes(jpeg(im, 90))
            refs.append(remove.image_vectors([remove.Entry("image", f"{i}.jpg", 1)], Path(tmp)))

    def found(sample, ref) -> bool:
        vec, det, framed = sample
        rv, rd, _ = ref
        k = len(rv)
        return near_copies_of(["s"], {"s": vec}, {"s": det}, {"s": framed} if framed else {}, rv, rd, np.ones(k, bool),
                              np.full(k, cfg.within_threshold), np.full(k, cfg.within_detail_threshold))[0] is not None

    per_edit: dict[str, list[int]] = {}
    for i, im in enumerate(pics):
        for name, e in edits(im).items():
            per_edit.setdefault(name, []).append(int(found(described(as_ingested(e)), refs[i])))
    plain = [described(as_ingested(im)) for im in pics]
    false = sum(found(plain[j], refs[i]) for i in range(len(pics)) for j in range(len(pics)) if i != j)
    result = {
        "code": code(), "pictures": len(pics), "seconds": round(time.time() - t0, 1),
        "thresholds": {"thumbnail": cfg.within_threshold, "detail": cfg.within_detail_threshold},
        "recall": {name: f"{sum(v)}/{len(v)}" for name, v in per_edit.items()},
        "recall_all_edits": round(sum(map(sum, per_edit.values())) / sum(map(len, per_edit.values())), 3),
        "false_matches": f"{false}/{len(pics) * (len(pics) - 1)}",
        "unedited_found": f"{sum(found(plain[i], refs[i]) for i in range(len(pics)))}/{len(pics)}",
    }
    result["at_scale"] = at_scale()
    for k, v in result["recall"].items():
        print(f"{k:26s} {v}")
    print(f"false matches {result['false_matches']}, unedited found {result['unedited_found']}")
    print(f"at scale: {result['at_scale']}")
    write_results("removal_recall", result)


if __name__ == "__main__":
    main()
