"""Evaluation sets that training data must not leak into, and their cached reference indexes.

Kinds: `folder` (image files under a path), `webdataset` (tar shards: a file, folder or glob),
`parquet` (a column of image bytes), `builtin`: `demo_heldout` (the demo source's held-out split),
`fashion_mnist` (Debian package dataset-fashion-mnist, its 10k test images), `digits`
(scikit-learn's 1,797 8x8 digits).

An index is built once per (set content, descriptor parameters) and cached under `cache_dir`;
unreadable images inside a set are skipped and counted, an empty or missing set is an error.
"""
from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

import numpy as np

from infra.configtools import join, require
from infra.errors import UserError

from .imagehash import crops, describe
from .neardup import NearDupIndex

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
from trainers.evaluation.datasets import FASHION_MNIST, digits, fashion_mnist_images, read_regular  # noqa: E402 - one reader
BUILTINS = ("demo_heldout", "fashion_mnist", "digits")


@dataclass
class EvalSetConfig:
    name: str = ""
    kind: Literal["folder", "webdataset", "parquet", "builtin"] = "builtin"
    path: str = ""          # a folder / shard path or glob / parquet file; for builtin: its name
    image_col: str = "image"
    id_col: str | None = None
    # the set's captions, matched against alt-text (stages/dedup/caption_match.py): a parquet set's column
    # of captions (a string, or a list of strings, per image); a webdataset set's .txt members are
    # its captions without this
    caption_col: str | None = None

    def validate(self, prefix: str) -> None:
        require(bool(self.name) and ":" not in self.name, join(prefix, "name"),
                f"each evaluation set needs a name without ':', got {self.name!r}")
        if self.kind == "builtin":
            require(self.path in BUILTINS, join(prefix, "path"),
                    f"builtin evaluation set {self.path!r} unknown; choose one of {', '.join(BUILTINS)}")
        else:
            require(bool(self.path), join(prefix, "path"), f"kind {self.kind} needs a path")


def check_exists(es: EvalSetConfig, run_dir: Path | None) -> None:
    """Fail before any work if a set cannot be found."""
    if es.kind == "builtin":
        if es.path == "fashion_mnist" and not FASHION_MNIST.is_file():
            raise UserError(f"evaluation set {es.name}: {FASHION_MNIST} not found; install the Debian "
                            "package dataset-fashion-mnist (make install does where apt is available)")
        return
    if es.kind == "webdataset":
        if not _shard_paths(es.path):
            raise UserError(f"evaluation set {es.name}: no .tar shards at {es.path}")
        return
    if not Path(es.path).exists():
        raise UserError(f"evaluation set {es.name}: {es.path} does not exist")


def _shard_paths(path: str) -> list[str]:
    p = Path(path)
    if p.is_dir():
        return sorted(str(x) for x in p.glob("*.tar"))
    return sorted(glob.glob(path)) if any(c in path for c in "*?[") else ([path] if p.is_file() else [])


def iter_images(es: EvalSetConfig, run_dir: Path | None) -> Iterator[tuple[str, object]]:
    """Yield (id, image) where image is bytes or an array."""
    if es.kind == "folder":
        root = Path(es.path)
        for f in sorted(root.rglob("*")):
            if f.suffix.lower() in IMAGE_SUFFIXES:
                yield str(f.relative_to(root)).replace(".", "_"), read_regular(f, es.name)
    elif es.kind == "webdataset":
        from infra.tars import tar_samples

        for shard in _shard_paths(es.path):
            for key, parts in tar_samples(shard, f"evaluation set {es.name}: {shard}"):
                for ext, data in parts.items():
                    if "." + ext.lower() in IMAGE_SUFFIXES:
                        yield f"{Path(shard).stem}/{key.rpartition('/')[-1]}", data
    elif es.kind == "parquet":
        import pyarrow.parquet as pq

        from infra.bombs import check_parquet

        check_parquet(Path(es.path), f"evaluation set {es.name}", "an evaluation set's values may decode to at most "
                      "100 times its file's size (infra/bombs.py)")
        table = pq.read_table(es.path)
        if es.image_col not in table.column_names:
            raise UserError(f"evaluation set {es.name}: {es.path} has no column {es.image_col!r}")
        ids = table.column(es.id_col).to_pylist() if es.id_col else range(table.num_rows)
        for i, cell in zip(ids, table.column(es.image_col).to_pylist()):
            yield str(i), cell["bytes"] if isinstance(cell, dict) else cell
    elif es.path == "demo_heldout":
        import pyarrow.parquet as pq

        base = (run_dir or Path(".")) / "source" / "eval"
        if not (base / "eval.parquet").is_file():
            raise UserError(f"evaluation set {es.name}: the demo's held-out split exists only for "
                            "source.kind synthetic (no source/eval/eval.parquet in this run)")
        for r in pq.read_table(base / "eval.parquet").to_pylist():
            yield r["id"], (base / r["path"]).read_bytes()
    elif es.path == "fashion_mnist":
        for i, img in enumerate(fashion_mnist_images()):
            yield f"test{i:05d}", img
    elif es.path == "digits":
        for i, img in enumerate(digits()[0]):
            yield f"digit{i:04d}", img


def iter_captions(es: EvalSetConfig, run_dir: Path | None = None) -> Iterator[tuple[str, str]]:
    """(image id, caption) of a set that has captions: a parquet set's `caption_col`, a webdataset
    set's .txt members, the demo's held-out split (its captions come from the same small grammar
    as its training captions: the demo matches whole captions only, `caption_ngram: 0`). The other
    builtins are class labels: none."""
    if es.kind == "builtin" and es.path == "demo_heldout":
        import pyarrow.parquet as pq

        path = (run_dir or Path(".")) / "source" / "eval" / "eval.parquet"
        if path.is_file():
            for i, c in zip(*(pq.read_table(path, columns=["id", "caption"]).column(x).to_pylist() for x in ("id", "caption"))):
                yield str(i), c
    elif es.kind == "parquet" and es.caption_col:
        import pyarrow.parquet as pq

        have = pq.read_schema(es.path).names
        if es.caption_col not in have:
            raise UserError(f"evaluation set {es.name}: {es.path} has no column {es.caption_col!r} "
                            f"(stages.dedup.eval_sets caption_col; its columns: {', '.join(have[:10])})")
        table = pq.read_table(es.path, columns=[c for c in (es.caption_col, es.id_col) if c])
        ids = table.column(es.id_col).to_pylist() if es.id_col else range(table.num_rows)
        for i, cell in zip(ids, _texts(table.column(es.caption_col))):
            for c in (cell if isinstance(cell, list) else [cell]):
                if isinstance(c, str) and c.strip():
                    yield str(i), c
    elif es.kind == "webdataset":
        from infra.tars import tar_samples

        for shard in _shard_paths(es.path):
            for key, parts in tar_samples(shard, f"evaluation set {es.name}: {shard}"):
                if "txt" in parts:
                    yield f"{Path(shard).stem}/{key.rpartition('/')[-1]}", parts["txt"].decode("utf-8", "replace")


def caption_notes(es: EvalSetConfig) -> list[str]:
    """What `capline check` says of a parquet set's caption column before a run: cells that are not
    valid UTF-8 (Parquet does not check) are named by row; the run reads them with U+FFFD in place
    of the bad bytes, so a caption planted there may match less."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if es.kind != "parquet" or not es.caption_col or not Path(es.path).is_file() \
            or es.caption_col not in pq.read_schema(es.path).names:
        return []
    column = pq.read_table(es.path, columns=[es.caption_col]).column(es.caption_col)
    lists = pa.types.is_list(column.type)
    if lists:
        column = pc.list_flatten(column)
    try:
        column.validate(full=True)
        return []
    except pa.ArrowInvalid:
        pass
    raw = column.cast(pa.binary()).to_pylist()
    bad = []
    for row, b in enumerate(raw):
        try:
            b is None or b.decode("utf-8")
        except UnicodeDecodeError:
            bad.append(row)
    return [f"evaluation set {es.name}: {len(bad)} caption(s) in {es.path} column {es.caption_col!r} are not valid "
            f"UTF-8 (first: row {bad[0]}{' of the flattened lists' if lists else ''}); the "
            "run reads them with U+FFFD for the bad bytes, so dedup's caption match may miss them: re-encode the "
            "column as UTF-8"] if bad else []


def _texts(column) -> list:
    """A caption column's cells as Python strings (or lists of them). Parquet does not check that a
    string column is UTF-8: invalid bytes are decoded as U+FFFD, as a webdataset set's .txt members
    are, rather than ending the run with a traceback after its downloads."""
    import pyarrow as pa

    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        binary = pa.list_(pa.binary()) if pa.types.is_list(column.type) else pa.binary()
        fix = lambda b: b.decode("utf-8", "replace") if isinstance(b, bytes) else b  # noqa: E731
        return [[fix(b) for b in cell] if isinstance(cell, list) else fix(cell)
                for cell in column.cast(binary).to_pylist()]


def stat_fingerprint(es: EvalSetConfig) -> str:
    """Cheap change detector for a set's files (names, sizes, mtimes), for stage fingerprints.

    Builtins need none: the demo split is part of the source stage's output, the others are fixed.
    """
    if es.kind == "builtin":
        return ""
    files = _shard_paths(es.path) if es.kind == "webdataset" else (
        sorted(str(f) for f in Path(es.path).rglob("*") if f.is_file()) if Path(es.path).is_dir() else [es.path])
    parts = []
    for f in files:
        try:
            st = Path(f).stat()
            parts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(f"{f}:missing")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def content_digest(es: EvalSetConfig, run_dir: Path | None) -> str:
    h = hashlib.sha256(json.dumps([es.kind, es.path if es.kind == "builtin" else ""]).encode())
    for key, image in iter_images(es, run_dir):
        h.update(key.encode())
        h.update(image if isinstance(image, bytes) else np.ascontiguousarray(image).tobytes())
    return h.hexdigest()


def cached_digest(es: EvalSetConfig, run_dir: Path | None, cache_dir: Path) -> str:
    """`content_digest`, read again only when the set's files changed (names, sizes, mtimes:
    `stat_fingerprint`): a run does not read 50,000 evaluation images just to learn they are the
    ones it indexed before. Builtin sets (small, or the run's own demo split) are digested each time."""
    stat = stat_fingerprint(es)
    if not stat:
        return content_digest(es, run_dir)
    where = cache_dir / "digests" / f"{hashlib.sha256(json.dumps([es.kind, str(es.path), stat]).encode()).hexdigest()[:32]}.txt"
    try:
        text = where.read_text().strip()
        if len(text) == 64:
            return text
    except OSError:
        pass
    digest = content_digest(es, run_dir)
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = where.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(digest)
    tmp.replace(where)
    return digest


BATCH = 256   # evaluation images per description task
ALIKE_SAMPLE = 1000   # a set's images whose nearest other image is measured (`nearest_others`)


def nearest_others(index: NearDupIndex) -> list[float]:
    """How alike a set's images are to each other under its descriptor: for up to ALIKE_SAMPLE of
    them (the same ones on every build), the cosine of the nearest reference of another image, whole
    image against any crop, sorted. Where many are at the stage's threshold, images of the set's kind
    that are not in it are dropped as its duplicates too (benchmarks/eval_recall.py: Fashion-MNIST's
    training split, 50,000 images, against 2,000 of its test split)."""
    _, first = np.unique(index.ids, return_index=True)    # an image's first reference: the whole image
    if len(first) > ALIKE_SAMPLE:
        first = np.sort(np.random.default_rng(0).choice(first, ALIKE_SAMPLE, replace=False))
    return sorted(round(float(s), 4) for s in index.nearest_other(first))


def alike_share(stats: dict, threshold: float) -> float | None:
    """The share of a set's measured images with another of its images at `threshold` or above."""
    near = stats.get("nearest_other")
    return round(float(np.mean(np.asarray(near) >= threshold)), 4) if near else None


def describe_batch(batch: list, describer=None) -> tuple[list, list, list, list]:
    """(ids, descriptors, mean colours, [(id, why unreadable)]) of (id, image) pairs: every image
    with its crops (the hash descriptor), or the image alone through `describer`."""
    ids, vecs, means, bad = [], [], [], []
    for image_id, image in batch:
        try:
            got = [describe(v) if describer is None else describer(v)
                   for v in (crops(image) if describer is None else [image])]
        except Exception as err:  # noqa: BLE001 - an unreadable image is a counted skip
            bad.append((image_id, getattr(err, "reason", type(err).__name__)))
            continue
        for d, m in got:
            ids.append(image_id)
            vecs.append(d)
            means.append(m)
    return ids, vecs, means, bad


def _described(es: EvalSetConfig, run_dir: Path | None, describer, run):
    """describe_batch over the set, in order: in Ray tasks when a cluster is up (the set is read here,
    where its files are; describing 28 crops of each image is the work), else in this process.
    An encoder describer (a model) runs here."""
    images = iter_images(es, run_dir)
    batches = iter(lambda: list(itertools.islice(images, BATCH)), [])
    if run is None or describer is not None:
        for batch in batches:
            yield describe_batch(batch, describer)
        return
    yield from run(describe_batch, [(batch,) for batch in batches], f"dedup: indexing {es.name}", num_cpus=1,
                   describe=lambda c: f"images {c[0][0][0]}..")


def build_reference(es: EvalSetConfig, run_dir: Path | None, cache_dir: Path, params: dict,
                    describer=None, log=print, run=None) -> tuple[Path, dict]:
    """Build (or find in the cache) the reference index of one set. Returns (index path, stats)."""
    check_exists(es, run_dir)
    key = hashlib.sha256((cached_digest(es, run_dir, cache_dir) + json.dumps(params, sort_keys=True)).encode()).hexdigest()[:24]
    path = cache_dir / f"{es.name}-{key}.npz"
    meta = path.with_suffix(".json")
    if path.is_file() and meta.is_file():
        stats = json.loads(meta.read_text())
        if "nearest_other" not in stats:        # cached before a set's likeness was measured
            stats["nearest_other"] = nearest_others(NearDupIndex.load(path))
            meta.write_text(json.dumps(stats))
        return path, {**stats, "cached": True}
    ids, vecs, means, skipped = [], [], [], 0
    for got in _described(es, run_dir, describer, run):
        ids += got[0]
        vecs += got[1]
        means += got[2]
        for image_id, err in got[3]:
            skipped += 1
            log(f"dedup: evaluation set {es.name}: skipped unreadable image {image_id} ({err})")
    n_images = len(set(ids))
    if n_images == 0:
        raise UserError(f"evaluation set {es.name}: no readable images at {es.path}")
    index = NearDupIndex(bits=params["bits"], colour_tol=params["colour_tol"])
    index.build(ids, np.stack(vecs), np.stack(means)).save(path)
    stats = {"images": n_images, "references": len(ids), "skipped_unreadable": skipped,
             "nearest_other": nearest_others(index)}
    meta.write_text(json.dumps(stats))
    log(f"dedup: indexed evaluation set {es.name}: {n_images} images ({len(ids)} references)")
    return path, {**stats, "cached": False}
