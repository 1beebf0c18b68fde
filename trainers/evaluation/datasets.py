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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

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


def _idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST's format): its array."""
    with gzip.open(path) as f:
        raw = f.read()
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


def fashion_mnist_labels(split: str = "t10k") -> np.ndarray:
    return _idx(FASHION_MNIST.with_name(f"{split}-labels-idx1-ubyte.gz")).astype(np.int64)


def fashion_mnist_images(split: str = "t10k") -> np.ndarray:
    return _idx(FASHION_MNIST.with_name(f"{split}-images-idx3-ubyte.gz"))


@dataclass
class LabelledSet:
    """A classification set with its images read on demand (`image(i)`: a probe draws its shots
    from a 60,000-image train split without decoding it). `split[i]`: "train" or "test" where the
    set has an official split, else None (eval.holdout of each class is held out). `selected`: the
    indices within `limit` (every index when there is none)."""
    name: str
    labels: list[str]
    split: list[str] | None
    read: Callable[[int], Image.Image]
    limit: int | None = None
    selected: list[int] = field(default_factory=list)

    def image(self, i: int) -> Image.Image:
        return self.read(i)

    def describe(self) -> dict:
        """What the result JSON records of the set: its size per split, what the limit kept."""
        def per_split(idx):
            out: dict[str, int] = {}
            for i in idx:
                key = self.split[i] if self.split else "all"
                out[key] = out.get(key, 0) + 1
            return dict(sorted(out.items()))
        return {"split": "official" if self.split else "eval.holdout of each class",
                "images": per_split(self.selected), "of": per_split(range(len(self.labels))), "limit": self.limit,
                "classes": len(set(self.labels))}


def _within_limit(labels: list[str], split: list[str] | None, limit: int | None) -> list[int]:
    """At most `limit` indices of each split, every class kept: a seeded shuffle, then classes taken
    in turn (the n-th image of every class before any class's n+1-th)."""
    if not limit:
        return list(range(len(labels)))
    groups: dict[str, list[int]] = {}
    for i in range(len(labels)):
        groups.setdefault(split[i] if split else "all", []).append(i)
    kept = []
    for name, idx in sorted(groups.items()):
        rng = random.Random(f"{name}:0")
        rng.shuffle(idx)
        rank, seen = {}, {}
        for i in idx:
            rank[i] = seen.get(labels[i], 0)
            seen[labels[i]] = rank[i] + 1
        kept += sorted(idx, key=lambda i: (rank[i], labels[i]))[:limit]
    return sorted(kept)


def labelled_set(s: ClassificationSet, run_dir: Path) -> LabelledSet:
    """A classification set's labels and official split, its images readable one by one."""
    def done(labels, split, read) -> LabelledSet:
        labels = [str(x) for x in labels]
        if not labels:
            raise UserError(f"evaluation set {s.name}: no labelled images")
        return LabelledSet(s.name, labels, split, read, s.limit, _within_limit(labels, split, s.limit))

    if s.kind == "builtin" and s.path == "digits":
        images, target = digits()     # no official split: 1,797 images
        return done([int(t) for t in target], None, lambda i: Image.fromarray(images[i]).convert("RGB"))
    if s.kind == "builtin":   # fashion_mnist: its official train (60,000) and test (t10k, 10,000) files
        if not FASHION_MNIST.is_file():
            raise UserError(f"evaluation set {s.name}: {FASHION_MNIST} not found; install the Debian package "
                            "dataset-fashion-mnist (make install does where apt is available)")
        parts = [p for p in ("train", "t10k") if FASHION_MNIST.with_name(f"{p}-images-idx3-ubyte.gz").is_file()]
        arrays = [fashion_mnist_images(p) for p in parts]
        labels = [FASHION_CLASSES[int(t)] for p in parts for t in fashion_mnist_labels(p)]
        split = [("test" if p == "t10k" else "train") for p, a in zip(parts, arrays) for _ in range(len(a))]
        offsets = np.cumsum([0] + [len(a) for a in arrays])

        def read(i):
            k = int(np.searchsorted(offsets, i, side="right")) - 1
            return Image.fromarray(arrays[k][i - offsets[k]]).convert("RGB")
        return done(labels, split if len(parts) == 2 else None, read)
    path = resolve(s.path, run_dir)
    if s.kind == "folder":
        if not path.is_dir():
            raise UserError(f"evaluation set {s.name}: {path} is not a folder of class subfolders")
        official = (path / "train").is_dir() and (path / "test").is_dir()
        roots = [("train", path / "train"), ("test", path / "test")] if official else [(None, path)]
        files = [(part, c.name, f) for part, root in roots
                 for c in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
                 for f in sorted(c.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES]
        if not files:
            raise UserError(f"evaluation set {s.name}: no images in class subfolders of {path}"
                            + (" (train/ and test/)" if official else ""))
        return done([c for _, c, _ in files], [p for p, _, _ in files] if official else None,
                    lambda i: _open(read_regular(files[i][2], s.name), str(files[i][2])))
    import pyarrow.parquet as pq

    if not path.is_file():
        raise UserError(f"evaluation set {s.name}: {path} does not exist")
    from infra.bombs import check_parquet

    check_parquet(path, f"evaluation set {s.name}", "an evaluation set's values may decode to at most 100 times its "
                  "file's size (infra/bombs.py)")
    t = pq.read_table(path)
    for col in (s.image_col, s.label_col, s.split_col):
        if col and col not in t.column_names:
            raise UserError(f"evaluation set {s.name}: {path} has no column {col!r} (columns: {', '.join(t.column_names)})")
    split = None
    if s.split_col:
        split = [str(x).strip().lower() for x in t.column(s.split_col).to_pylist()]
        odd = sorted(set(split) - {"train", "test"})
        if odd or "train" not in split or "test" not in split:
            raise UserError(f"evaluation set {s.name}: split_col {s.split_col!r} must hold train and test rows"
                            + (f"; it also holds {', '.join(odd[:5])}" if odd else ""))
    cells = t.column(s.image_col).to_pylist()

    def read(i):
        cell = cells[i]
        if isinstance(cell, dict):   # HF-style {"bytes": ..., "path": ...}
            cell = cell.get("bytes")
        if isinstance(cell, str):    # a path relative to the Parquet file
            cell = read_regular(inside(path.parent, cell, f"evaluation set {s.name}, row {i}"), s.name)
        return _open(cell, f"evaluation set {s.name}, row {i}")
    return done(t.column(s.label_col).to_pylist(), split, read)


def prompt_texts(s: ClassificationSet, labels: list[str], run_dir: Path) -> tuple[dict[str, str], list[str]]:
    """A zero-shot set's -> ({label: class name}, templates), from its files where it names them."""
    names = {c: c for c in labels}
    if s.class_names:
        f = resolve(s.class_names, run_dir)
        if not f.is_file():
            raise UserError(f"evaluation set {s.name}: class_names {f} does not exist")
        order = sorted(set(labels))
        if f.suffix == ".json":
            doc = json.loads(f.read_text())
            given = ({str(k): str(v) for k, v in doc.items()} if isinstance(doc, dict)
                     else dict(zip(order, map(str, doc))) if isinstance(doc, list) else None)
            if given is None:
                raise UserError(f"evaluation set {s.name}: class_names {f} must be a JSON object or list")
        else:
            lines = [ln.strip() for ln in f.read_text().splitlines() if ln.strip()]
            if len(lines) != len(order):
                raise UserError(f"evaluation set {s.name}: class_names {f} has {len(lines)} names for {len(order)} "
                                "labels (one per line, in the labels' sorted order)")
            given = dict(zip(order, lines))
        missing = [c for c in order if c not in given]
        if missing:
            raise UserError(f"evaluation set {s.name}: class_names {f} names no class for label(s) "
                            f"{', '.join(missing[:5])}")
        names = {c: given[c] for c in order}
    templates = list(s.templates)
    if s.templates_file:
        f = resolve(s.templates_file, run_dir)
        if not f.is_file():
            raise UserError(f"evaluation set {s.name}: templates_file {f} does not exist")
        templates = (json.loads(f.read_text()) if f.suffix == ".json"
                     else [ln.strip() for ln in f.read_text().splitlines() if ln.strip()])
        if not templates or not all(isinstance(t, str) and "{}" in t for t in templates):
            raise UserError(f"evaluation set {s.name}: templates_file {f}: every template needs a {{}} for the "
                            "class name, one per line (or a JSON list)")
    return names, templates


def load_classification(s: ClassificationSet, run_dir: Path) -> tuple[list[Image.Image], list[str]]:
    """-> (images, class names per image) of the set within its limit, every split."""
    data = labelled_set(s, run_dir)
    return [data.image(i) for i in data.selected], [data.labels[i] for i in data.selected]


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
        for image_id in [i for i in files if i in refs][: s.limit or None]:
            f = inside(root, files[image_id], f"captioning set {s.name}, image {image_id}")
            out.append((str(image_id), _open(read_regular(f, s.name), str(f)), refs[image_id]))
    elif s.kind == "karpathy":
        if not path.is_file():
            raise UserError(f"captioning set {s.name}: {path} does not exist")
        try:
            doc = json.loads(path.read_text())
            rows = [(str(im.get("cocoid", im.get("imgid", n))), str(Path(im.get("filepath", "")) / im["filename"]),
                     [x["raw"] for x in im["sentences"]], im["split"]) for n, im in enumerate(doc["images"])]
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(f"captioning set {s.name}: {path} is not a Karpathy-style captions file (images with "
                            f"filename, split and sentences[].raw, as dataset_coco.json): {err}") from None
        chosen = [r for r in rows if r[3] == s.split]
        if not chosen:
            have = sorted({r[3] for r in rows})
            raise UserError(f"captioning set {s.name}: no images of split {s.split!r} in {path} (it has "
                            f"{', '.join(have) or 'none'}); set eval.captioning split")
        root = resolve(s.images, run_dir)
        for image_id, name, refs_, _ in chosen[: s.limit or None]:
            f = inside(root, name, f"captioning set {s.name}, image {image_id}")
            out.append((image_id, _open(read_regular(f, s.name), str(f)), refs_))
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
    if s.kind in ("vg_relation", "vg_attribution", "sugarcrepe"):
        return _published_wordorder(s, path, resolve(s.images, run_dir))
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


def _published_wordorder(s: WordOrderSet, path: Path, images: Path) -> list[tuple[Image.Image, str, dict]]:
    """ARO's VG-Relation / VG-Attribution and SugarCrepe in their published JSON. A case's one
    negative is keyed by what it tests: the relation's name (VG-Relation: ARO reports the mean
    accuracy over relations), "attribute" (VG-Attribution), the file's category (SugarCrepe)."""
    out = []
    if s.kind == "sugarcrepe":
        files = sorted(path.glob("*.json")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise UserError(f"word-order set {s.name}: no SugarCrepe JSON files at {path}")
        for f in files:
            try:
                doc = json.loads(f.read_text())
                rows = [(str(v["filename"]), str(v["caption"]), str(v["negative_caption"])) for v in doc.values()]
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise UserError(f"word-order set {s.name}: {f} is not SugarCrepe's format ({{id: {{filename, caption, "
                                f"negative_caption}}}}): {err}") from None
            for name, true, neg in rows[: s.limit or None]:
                img = inside(images, name, f"word-order set {s.name}, {f.name}")
                out.append((_open(read_regular(img, s.name), str(img)), true, {f.stem: neg}))
        return out
    if not path.is_file():
        raise UserError(f"word-order set {s.name}: {path} does not exist")
    try:
        doc = json.loads(path.read_text())
        rows = [(str(r["image_path"]), [float(r[k]) for k in ("bbox_x", "bbox_y", "bbox_w", "bbox_h")],
                 str(r["true_caption"]), str(r["false_caption"]),
                 str(r["relation_name"]) if s.kind == "vg_relation" else "attribute") for r in doc]
    except (ValueError, KeyError, TypeError) as err:
        field = "relation_name" if s.kind == "vg_relation" else "attributes"
        raise UserError(f"word-order set {s.name}: {path} is not ARO's {s.kind} format (a list of {{image_path, "
                        f"bbox_x, bbox_y, bbox_w, bbox_h, true_caption, false_caption, {field}}}): {err}") from None
    for name, (x, y, w, h), true, neg, cat in rows[: s.limit or None]:
        f = inside(images, name, f"word-order set {s.name}")
        img = _open(read_regular(f, s.name), str(f))
        out.append((img.crop((int(x), int(y), int(x + w), int(y + h))), true, {cat: neg}))
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
