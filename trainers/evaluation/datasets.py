"""Reading evaluation datasets from files: classification sets (builtin, class folders, Parquet),
captioning sets (COCO captions JSON with an image folder, WebDataset with .txt), word-order sets
(JSON-lines pairs; ARO order perturbations generated from a captioning set). Nothing here knows
how the data was made: the demo's held-out split is files of these kinds.

Readers take untrusted input: tars through infra/tars.py, folders refuse symlinks and
special files, an unreadable image is an error naming it.
"""
from __future__ import annotations

import glob
import gzip
import json
import random
import stat
from pathlib import Path

import numpy as np
from PIL import Image

from infra.errors import UserError

from .config import CaptionSet, ClassificationSet, WordOrderSet

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
FASHION_CLASSES = ("T-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                   "ankle boot")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def resolve(path: str, run_dir: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(run_dir) / p


def _open(data, where: str) -> Image.Image:
    """An evaluation image under the one untrusted-input policy (infra/media.py): format
    allow-list, pixel cap from the header, full decode; a refusal names the file."""
    from infra.media import ImageRefused, decode

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise UserError(f"{where}: not image bytes ({type(data).__name__})")
    try:
        return decode(data)
    except ImageRefused as err:
        raise UserError(f"{where}: refused as an image ({err.reason}: {err.detail})") from None


def inside(root: Path, name, what: str) -> Path:
    """`name` (from a set's own files: a COCO file_name, a JSON-lines image) as a path under root;
    an absolute path or one that climbs out (`..`) is refused, not read."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UserError(f"{what}: image name {name!r} is not a relative path")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise UserError(f"{what}: image name {name!r} points outside {root}; a set names its images relative "
                        "to its own folder")
    return root / rel


def read_regular(f: Path, name: str) -> bytes:
    """A set's image file, if it is a regular file of sane size: a symlink (to /dev/zero, to
    /etc/shadow) or a device in an evaluation folder is refused, not followed."""
    from infra.tars import MAX_MEMBER_BYTES

    st = f.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise UserError(f"evaluation set {name}: {f} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a regular file'}; "
                        "an evaluation folder holds regular image files only")
    if st.st_size > MAX_MEMBER_BYTES:
        raise UserError(f"evaluation set {name}: {f} is {st.st_size} bytes, over {MAX_MEMBER_BYTES} for one image")
    with open(f, "rb") as fh:
        return fh.read(MAX_MEMBER_BYTES + 1)


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 8x8 digits as uint8 images (0..255), and their labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images * (255 / 16)).astype(np.uint8), d.target


def fashion_mnist_labels() -> np.ndarray:
    with gzip.open(FASHION_MNIST.with_name("t10k-labels-idx1-ubyte.gz")) as f:
        return np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)


def fashion_mnist_images() -> np.ndarray:
    with gzip.open(FASHION_MNIST) as f:
        raw = f.read()
    n, rows, cols = (int.from_bytes(raw[i:i + 4], "big") for i in (4, 8, 12))
    return np.frombuffer(raw, np.uint8, offset=16).reshape(n, rows, cols)


def load_classification(s: ClassificationSet, run_dir: Path) -> tuple[list[Image.Image], list[str]]:
    """-> (images, class names per image)."""
    limit = s.limit or None
    if s.kind == "builtin" and s.path == "digits":
        images, target = digits()
        return [Image.fromarray(im).convert("RGB") for im in images[:limit]], [str(int(t)) for t in target[:limit]]
    if s.kind == "builtin":   # fashion_mnist
        if not FASHION_MNIST.is_file():
            raise UserError(f"evaluation set {s.name}: {FASHION_MNIST} not found; install the Debian package "
                            "dataset-fashion-mnist (make install does where apt is available)")
        imgs = [Image.fromarray(a).convert("RGB") for a in fashion_mnist_images()[:limit]]
        return imgs, [FASHION_CLASSES[int(t)] for t in fashion_mnist_labels()[:limit]]
    path = resolve(s.path, run_dir)
    if s.kind == "folder":
        if not path.is_dir():
            raise UserError(f"evaluation set {s.name}: {path} is not a folder of class subfolders")
        files = [(c.name, f) for c in sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink())
                 for f in sorted(c.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES]
        if limit:   # every class, not the first classes only
            rng = random.Random(0)
            rng.shuffle(files)
            files = sorted(files[:limit], key=lambda x: (x[0], x[1].name))
        if not files:
            raise UserError(f"evaluation set {s.name}: no images in class subfolders of {path}")
        return [_open(read_regular(f, s.name), str(f)) for _, f in files], [c for c, _ in files]
    import pyarrow.parquet as pq

    if not path.is_file():
        raise UserError(f"evaluation set {s.name}: {path} does not exist")
    from infra.bombs import check_parquet

    check_parquet(path, f"evaluation set {s.name}", "an evaluation set's values may decode to at most 100 times its "
                  "file's size (infra/bombs.py)")
    t = pq.read_table(path)
    for col in (s.image_col, s.label_col):
        if col not in t.column_names:
            raise UserError(f"evaluation set {s.name}: {path} has no column {col!r} (columns: {', '.join(t.column_names)})")
    cells, labels = t.column(s.image_col).to_pylist()[:limit], t.column(s.label_col).to_pylist()[:limit]
    imgs = []
    for i, cell in enumerate(cells):
        if isinstance(cell, dict):   # HF-style {"bytes": ..., "path": ...}
            cell = cell.get("bytes")
        if isinstance(cell, str):    # a path relative to the Parquet file
            cell = read_regular(inside(path.parent, cell, f"evaluation set {s.name}, row {i}"), s.name)
        imgs.append(_open(cell, f"evaluation set {s.name}, row {i}"))
    return imgs, [str(x) for x in labels]


def load_captions(s: CaptionSet, run_dir: Path) -> list[tuple[str, Image.Image, list[str]]]:
    """-> [(image id, image, reference captions)]."""
    path = resolve(s.path, run_dir)
    out = []
    if s.kind == "coco":
        if not path.is_file():
            raise UserError(f"captioning set {s.name}: {path} does not exist")
        try:
            doc = json.loads(path.read_text())
            files = {im["id"]: im["file_name"] for im in doc["images"]}
            refs: dict = {}
            for a in doc["annotations"]:
                refs.setdefault(a["image_id"], []).append(a["caption"])
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(f"captioning set {s.name}: {path} is not a COCO captions file "
                            f"(images with id and file_name, annotations with image_id and caption): {err}") from None
        root = resolve(s.images, run_dir)
        for image_id in list(files)[: s.limit or None]:
            if image_id not in refs:
                continue
            f = inside(root, files[image_id], f"captioning set {s.name}, image {image_id}")
            out.append((str(image_id), _open(read_regular(f, s.name), str(f)), refs[image_id]))
    else:
        from infra.tars import tar_samples

        p = path
        shards = sorted(str(x) for x in p.glob("*.tar")) if p.is_dir() else sorted(glob.glob(str(p)))
        if not shards:
            raise UserError(f"captioning set {s.name}: no .tar shards at {p}")
        for shard in shards:
            for key, parts in tar_samples(shard, f"captioning set {s.name}: {shard}"):
                parts = {ext.lower(): data for ext, data in parts.items()}
                img = next((parts[e] for e in ("jpg", "jpeg", "png", "webp") if e in parts), None)
                if img is None or "txt" not in parts:
                    continue
                out.append((key, _open(img, f"{shard}:{key}"), [parts["txt"].decode("utf-8", "replace")]))
                if s.limit and len(out) >= s.limit:
                    return out
    if not out:
        raise UserError(f"captioning set {s.name}: no captioned images in {path}")
    return out


def load_wordorder(s: WordOrderSet, run_dir: Path, captions: dict[str, list]) -> list[tuple[Image.Image, str, dict]]:
    """-> [(image, true caption, {category: negative caption})]. captions: loaded captioning sets."""
    if s.kind == "aro":
        from .aro import aro_case

        # every reference caption is a case, as in ARO; the seed follows the case, not the run
        return [(img, *aro_case(ref, 1000 * i + j)) for i, (_, img, refs) in enumerate(captions[s.source])
                for j, ref in enumerate(refs)]
    path = resolve(s.path, run_dir)
    if not path.is_file():
        raise UserError(f"word-order set {s.name}: {path} does not exist")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            f = inside(path.parent, r["image"], f"word-order set {s.name}, line {n}")
            out.append((_open(read_regular(f, s.name), str(f)), r["caption"], dict(r["negatives"])))
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(f"word-order set {s.name}: {path} line {n}: expected {{image, caption, negatives}} ({err})") from None
    return out


def check_exists(ec) -> None:
    """Before a run: builtin sets that are not installed, absolute paths that do not exist (paths
    relative to the run folder may be made by the run itself, like the demo's held-out split)."""
    for s in [*ec.fewshot, *ec.zeroshot]:
        if s.kind == "builtin" and s.path == "fashion_mnist" and not FASHION_MNIST.is_file():
            raise UserError(f"evaluation set {s.name}: {FASHION_MNIST} not found; install the Debian package "
                            "dataset-fashion-mnist, or remove the set from eval.fewshot / eval.zeroshot")
        if s.kind != "builtin" and Path(s.path).expanduser().is_absolute() and not Path(s.path).expanduser().exists():
            raise UserError(f"evaluation set {s.name}: {s.path} does not exist")
    if any(w.kind == "aro" for w in ec.wordorder):
        from .postag import _lexicon

        _lexicon()      # ARO's noun/adjective perturbations: WordNet must be there before training starts
    for c in ec.captioning:
        for p in (c.path, c.images):
            if p and Path(p).expanduser().is_absolute() and not any(ch in p for ch in "*?[") \
                    and not Path(p).expanduser().exists():
                raise UserError(f"captioning set {c.name}: {p} does not exist")
