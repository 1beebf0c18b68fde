"""The dedup stage: decontaminate against evaluation sets, then remove duplicates within the data.

1. Each evaluation set in `eval_sets` gets a reference index (stages/eval_sets.py; built once and
   cached by content and parameters).
2. A Ray task per partition reads its images through the sample index, describes each once
   (stages/imagehash.py), searches the evaluation indexes (one copy per node, in the object store)
   and writes `described/<key>.desc.parquet`: descriptor, SimHash code, mean colour, pixel and
   URL+caption hashes. Kept across runs by the partition's content and the config alone.
3. A cheap task per partition makes its signatures for this run's band plan (banded LSH,
   stages/lsh.py: bands wider and more of them as N grows, so a band value's group stays small and
   a pair at the threshold is found with the same probability) from those descriptions: its pixel
   hash, its URL+caption hash, a value per band, sorted into range buckets
   (`signed/<key>.sig.parquet`, kept across runs per band plan).
4. The group shuffle, through Ray's object store (Executor.shuffle): a task per partition reads its
   signature file once and hands each signature bucket its piece; a task per bucket (as many as the
   data and the cluster call for) groups them: equal pixels or URL+caption make `exact_duplicate`
   pairs; codes that share a band, are within the Hamming radius the cosine threshold implies and
   agree in colour make candidate pairs (exact copies in a large group pair with one
   representative: a placeholder repeated 10^4 times costs linear work). It writes them to one file
   bucketed by pair, and the candidates' sides to one file bucketed by partition group; a task per
   partition group reads each of its partitions' descriptors once and sends the wanted ones on,
   bucketed by pair (a join); a task per pair bucket checks its candidates by exact cosine and
   writes the edges (`_work/edges/`).
5. One task joins the edges into clusters (its memory grows with the duplicates, not the data): of
   each cluster the smallest key is kept, the rest name it in their detail `duplicate_of=<key>`.
   It writes the drops in one file, a row group per partition. A task per partition writes the
   verdicts, with a match at cosine >= `eval_threshold` dropped as `eval_duplicate` (the set in
   `match_set`, the evaluation item in `match_key`, the cosine as score; within-data duplicates name
   the key kept in `match_key`). The driver sees counts only. The same result with any number of
   workers or buckets.

With `encoder_checkpoint` (a capline model directory), encoder embeddings are compared as well, by
cosine at `encoder_threshold`, through the same index class: either path can flag a match.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import ClassVar
from dataclasses import dataclass, field
from typing import NamedTuple
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from infra.configtools import join, require
from infra.errors import UserError
from infra.hashing import hash_file as file_sha256

from infra.shuffle import map_groups, range_pieces, read_bucket, read_range, write_buckets, write_ranges

from .base import Decide, StageContext, StageResult
from .dataplane import (DROPPED, KEPT, PICTURE_COLUMNS, PartTask, bucket_pieces, by_location, hash_buckets,
                        picture_batches, reused_or_run)
from .eval_sets import EvalSetConfig, build_reference, check_exists
from .imagehash import describe, to_rgb_array
from .lsh import SMALL_GROUP, BandPlan, band_plan, band_values, close_in_groups, collapse_copies, mix64, runs
from .neardup import NearDupIndex


@dataclass
class DedupConfig:
    # how the work is cut or run, never what is decided: left out of the fingerprint and the card
    HOW: ClassVar[tuple] = ("bucket_rows", "cpus_per_worker", "cache_dir")
    REMOVED: ClassVar[dict] = {"num_workers": "the executor sizes parallelism from the cluster's CPUs",
                               "batch_size": "never read: tasks size their image batches by rows and bytes",
                               "shuffle_requests_per_sample": "signatures reach the group tasks through Ray's "
                                                              "object store: nothing is merged",
                               "merge_bytes": "signatures reach the group tasks through Ray's object store: "
                                              "nothing is merged"}
    eval_sets: list[EvalSetConfig] = field(default_factory=list)  # evaluation sets no training image may match (name, kind builtin|folder|parquet|..., path)
    eval_threshold: float = 0.92       # cosine of thumbnail descriptors
    within_threshold: float = 0.97  # cosine of thumbnail descriptors above which two training images are one
    colour_tol: float = 12.0           # max mean-colour difference per channel (0..255) for a match
    bits: int = 256                    # SimHash bits for the binary candidate search
    # an image encoder whose embeddings are compared too: a capline model directory, or a TorchScript
    # file (.pt: DataComp's ISC descriptor, an open_clip visual tower traced), fed encoder_image_size
    # pixels, shortest side resized and centre-cropped, ImageNet-normalised
    encoder_checkpoint: str | None = None
    # TorchScript is code: loading it runs whatever it holds (its __setstate__, its forward). It is
    # loaded only when its sha256 is pinned here, as an explicit choice to run that file
    encoder_sha256: str | None = None
    encoder_threshold: float = 0.95  # cosine of encoder embeddings above which an image matches
    encoder_image_size: int = 224  # pixels the encoder is fed (shortest side resized, centre crop)
    # evaluation captions in alt-text (stages/caption_match.py): drop the sample, flag it (kept, its
    # ledger row naming the caption), or off; matched: a whole caption of >= caption_min_words words
    # inside the alt-text, or a run of caption_ngram words in common (0: whole captions only)
    caption_match: str = "drop"
    caption_ngram: int = 10
    caption_min_words: int = 6
    cpus_per_worker: float = 0.75      # < 1 leaves room for Ray Data's read tasks on small machines
    # signature rows one group task takes on average (each ~100 bytes in memory): the number of
    # buckets grows with the data, never fewer than the cluster's CPUs can work on at once
    bucket_rows: int = 1_000_000
    cache_dir: str = "~/.cache/capline/eval-index"  # where evaluation-set indexes are kept between runs, by content
    def validate(self, prefix: str) -> None:
        for name in ("eval_threshold", "within_threshold", "encoder_threshold"):
            v = getattr(self, name)
            require(0 < v <= 1, join(prefix, name), f"a cosine threshold in (0, 1], got {v}")
        require(self.caption_match in ("drop", "flag", "off"), join(prefix, "caption_match"),
                f"drop, flag or off, got {self.caption_match!r}")
        require(self.caption_ngram == 0 or 4 <= self.caption_ngram <= 64, join(prefix, "caption_ngram"),
                f"must be 4..64 words, or 0 (whole captions only), got {self.caption_ngram}")
        require(2 <= self.caption_min_words <= 64, join(prefix, "caption_min_words"),
                f"must be 2..64 words, got {self.caption_min_words}")
        require(0 < self.cpus_per_worker <= 64, join(prefix, "cpus_per_worker"), "must be in (0, 64]")
        require(self.bucket_rows >= 1000, join(prefix, "bucket_rows"), f"must be >= 1000, got {self.bucket_rows}")
        require(self.bits % 64 == 0 and self.bits > 0, join(prefix, "bits"), "must be a positive multiple of 64")
        names = [e.name for e in self.eval_sets]
        require(len(names) == len(set(names)), join(prefix, "eval_sets"), f"set names repeat: {names}")
        if self.encoder_checkpoint:
            p = Path(self.encoder_checkpoint)
            require(p.is_dir() or (p.is_file() and p.suffix in TORCHSCRIPT), join(prefix, "encoder_checkpoint"),
                    f"{self.encoder_checkpoint} is neither a capline model directory nor a TorchScript file "
                    f"({', '.join(TORCHSCRIPT)})")
            script = torchscript_file(p)
            if script is not None:
                got = file_sha256(script)
                require(self.encoder_sha256 == got, join(prefix, "encoder_sha256"),
                        f"{script} is TorchScript, which runs code when it is loaded; to run it, pin it with "
                        f"{join(prefix, 'encoder_sha256')}: {got}" if self.encoder_sha256 is None else
                        f"{self.encoder_sha256} is not the sha256 of {script} ({got}): the file changed since it "
                        "was pinned; check it before pinning it again")
        require(16 <= self.encoder_image_size <= 1024, join(prefix, "encoder_image_size"), "must be 16..1024 pixels")


TORCHSCRIPT = (".pt", ".pth", ".torchscript")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def torchscript_file(path) -> Path | None:
    """The TorchScript file `path` names: itself, or the one a copied folder holds."""
    p = Path(path)
    if p.is_file() and p.suffix in TORCHSCRIPT:
        return p
    found = sorted(f for f in p.glob("*") if f.suffix in TORCHSCRIPT) if p.is_dir() and not (p / "model.json").is_file() else []
    return found[0] if found else None


class EncoderDescriber:
    """Unit image embeddings, no colour check: from a capline checkpoint (GAP of the final tokens), or
    from a TorchScript image model (its output flattened; shapes: (1, 3, S, S) -> (1, D)), loaded
    only if its bytes have the pinned `sha256` (checked where it is loaded: a worker's copy too)."""

    def __init__(self, checkpoint: str, image_size: int = 224, sha256: str | None = None):
        import torch

        self.torch = torch
        script = torchscript_file(checkpoint)
        if script is not None:
            got = file_sha256(script)
            if got != sha256:
                raise UserError(f"stages.dedup.encoder_checkpoint {script}: a TorchScript file (code) whose sha256 "
                                f"{got} is not the pinned stages.dedup.encoder_sha256 ({sha256}); not loaded")
            self.script = torch.jit.load(str(script), map_location="cpu").eval()
            self.size = image_size
        else:
            from trainers.models.checkpoint import load_model

            self.script = None
            self.model, self.cfg = load_model(checkpoint)
            self.model.eval()

    def _pixels(self, image) -> np.ndarray:
        """(3, S, S): shortest side to S (bicubic), centre crop, ImageNet's normalisation."""
        from PIL import Image

        img = Image.fromarray(to_rgb_array(image))
        w, h = img.size
        scale = self.size / min(w, h)
        img = img.resize((max(self.size, round(w * scale)), max(self.size, round(h * scale))), Image.BICUBIC)
        left, top = (img.size[0] - self.size) // 2, (img.size[1] - self.size) // 2
        x = np.asarray(img.crop((left, top, left + self.size, top + self.size)), np.float32).transpose(2, 0, 1) / 255.0
        return ((x - np.reshape(IMAGENET_MEAN, (3, 1, 1))) / np.reshape(IMAGENET_STD, (3, 1, 1))).astype(np.float32)

    def __call__(self, image) -> tuple[np.ndarray, np.ndarray]:
        from infra.media import to_input

        with self.torch.no_grad():
            if self.script is not None:
                out = self.script(self.torch.from_numpy(self._pixels(image))[None])
                f = (out[0] if isinstance(out, (tuple, list)) else out).reshape(-1).float().numpy()
            else:
                x = to_input(to_rgb_array(image), self.cfg.image_size)            # (3, S, S)
                f = self.model.image_features(self.torch.from_numpy(x)[None])[0].numpy()
        return (f / (np.linalg.norm(f) + 1e-6)).astype(np.float32), np.zeros(3, np.float32)


class Pair(NamedTuple):
    """Two samples a bucket found alike (a < b), with the partitions that hold them."""
    a: str
    part_a: str
    b: str
    part_b: str
    kind: str       # exact_duplicate | near_duplicate (a candidate until verified)


BLOCK = 1024                 # rows of a large signature group compared at once (memory: BLOCK x group x bits/8)
PIXELS, URL_CAPTION = 0, 1   # sig_kind of the exact signatures; band b is 2 + b


def sigs_per_sample(plan: BandPlan) -> int:
    return 2 + plan.bands          # its pixel hash, its URL+caption hash, a value per band


def bucket_count(samples: int, bucket_rows: int, cluster_cpus: float, per_sample: int) -> int:
    """Signature buckets (group tasks) for `samples` described images of `per_sample` signatures:
    enough that a bucket holds about `bucket_rows` signature rows, and at least one per CPU of the
    cluster while each still gets MIN_BUCKET_ROWS: every bucket costs each of its reducers a request
    per map file, which small data would pay for nothing. The pairs found do not depend on it."""
    rows = samples * per_sample
    by_size = math.ceil(rows / bucket_rows)
    return max(1, by_size, min(int(cluster_cpus), rows // MIN_BUCKET_ROWS))


MIN_BUCKET_ROWS = 100_000
PAIR_FAN_IN = 64      # signature buckets per pair bucket


_LOADED: dict = {}


def _indexes(storage, blobs: dict, names: tuple, encoder_checkpoint: str | None, image_size: int = 224,
             encoder_sha256: str | None = None):
    """Made once per worker process, however many partitions it describes. The driver loaded the
    evaluation indexes on its own disk, which a worker on another node cannot see: they arrive
    through Ray's object store as arrays (`blobs`: kind -> set name -> NearDupIndex.arrays()), which
    the worker processes of a node share without a copy each; only the Hamming index over the codes
    (32 bytes a reference) is each process's own. `names` identify them."""
    key = (storage.uri(), names, encoder_checkpoint)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = ({n: NearDupIndex.from_arrays(a) for n, a in blobs["hash"].items()},
                        {n: NearDupIndex.from_arrays(a) for n, a in blobs["encoder"].items()},
                        EncoderDescriber(str(storage.local_dir(encoder_checkpoint)), image_size, encoder_sha256)
                        if encoder_checkpoint
                        else None)
    return _LOADED[key]


def _describe_task(storage, part: str, file: str, blobs: dict, names: tuple,
                   encoder_checkpoint: str | None, cfg: DedupConfig, out: str) -> dict:
    """Ray task: describe one partition's images (each decoded once), search the evaluation sets,
    write each sample's descriptor, SimHash code, mean colour and exact hashes to `<out>.desc.parquet`,
    then the record that makes them reusable by a later run with the same partition. -> small counts.
    Nothing here depends on how many samples the run has: the band signatures, which do, are the
    sign step's (`_sign_task`), from this file, without decoding an image again."""
    from .dataplane import read_kept
    from .imagehash import simhash

    rows = by_location(read_kept(storage, file, ["key", "url", "caption", *PICTURE_COLUMNS]))
    indexes, enc_indexes, encoder = _indexes(storage, blobs, names, encoder_checkpoint, cfg.encoder_image_size,
                                             cfg.encoder_sha256)
    n = rows.num_rows
    vec16, means, codes = np.zeros((n, 768), np.float16), np.zeros((n, 3), np.float32), np.zeros((n, cfg.bits // 8), np.uint8)
    pix, ok = [bytes(16)] * n, np.zeros(n, bool)
    best_set, best_id, best_sim = [""] * n, [""] * n, np.full(n, -1.0, np.float32)
    at = 0
    # memory: a batch's images, whatever n is; each decoded once and seen without a resize's bars
    for batch, images in picture_batches(storage, rows):
        m = batch.num_rows
        vecs = np.zeros((m, 768), np.float32)
        for j, img in enumerate(images):
            i = at + j
            if img is None:
                continue     # ingest verified decodability; counted as undecodable if it happens
            arr = to_rgb_array(img)   # for the descriptor and the pixel hash
            vecs[j], means[i] = describe(arr)
            pix[i] = hashlib.sha256(arr.tobytes()).digest()[:16]
            ok[i] = True
        vec16[at:at + m], codes[at:at + m] = vecs, simhash(vecs, cfg.bits)
        for kind, idx_map in (("hash", indexes), ("encoder", enc_indexes)):
            if not idx_map:
                continue
            if kind == "encoder":
                got = [encoder(img)[0] if good else None for img, good in zip(images, ok[at:at + m])]
                dim = next((g.shape[0] for g in got if g is not None), 1)    # an encoder's own width
                qv = np.stack([g if g is not None else np.zeros(dim, np.float32) for g in got])
                qm = np.zeros((m, 3), np.float32)
            else:
                qv, qm = vecs, means[at:at + m]
            for name, index in idx_map.items():
                idx, sim = index.search(qv, qm)
                for q in range(m):
                    i = at + q
                    if idx[q] >= 0 and sim[q] > best_sim[i] and ok[i]:
                        best_set[i], best_id[i], best_sim[i] = f"{name}|{kind}", index.ids[idx[q]], sim[q]
        at += m
    keys = rows.column("key").to_pylist()
    url_caption = [hashlib.blake2b(f"{u}\0{c}".encode(), digest_size=16).digest() for u, c in
                   zip(rows.column("url").to_pylist(), rows.column("caption").to_pylist())]
    storage.write_table(f"{out}.desc.parquet", pa.table({
        "key": keys, "vec": pa.array([v.tobytes() for v in vec16], pa.binary()),
        "ok": ok, "eval_set": best_set, "eval_id": best_id, "eval_sim": best_sim,
        "code": pa.array([c.tobytes() for c in codes], pa.binary()),
        "mean": pa.FixedSizeListArray.from_arrays(pa.array(means.ravel()), 3),
        "pixels": pa.array(pix, pa.binary()), "url_caption": pa.array(url_caption, pa.binary())}))
    result = {"part": part, "described": n, "undecodable": int((~ok).sum())}
    storage.write_json(f"{out}.json", result)     # last: the file above is whole
    return result


SIGN_COLUMNS = ["key", "ok", "eval_set", "eval_sim", "code", "mean", "pixels", "url_caption"]


def _sign_task(storage, part: str, desc: str, cfg: DedupConfig, plan: BandPlan, n_buckets: int, out: str) -> dict:
    """Ray task: one partition's signatures for the band plan of this run's size, from its
    descriptions (`desc`): of the samples the within-data step considers (decodable, not an
    evaluation match), sorted by their hash, a row group per range bucket of `n_buckets`, as one
    file (infra/shuffle.py: no file per (partition, bucket)); then its record. -> small counts."""
    t = storage.read_table(desc, SIGN_COLUMNS)
    ok, sets, sims = (t.column(c).to_pylist() for c in ("ok", "eval_set", "eval_sim"))
    live = np.array([i for i in range(t.num_rows) if ok[i] and not _eval_hit(sets[i], sims[i], cfg)], np.int64)
    t = t.take(live)
    codes = _packed(t.column("code"), cfg.bits // 8)
    means = t.column("mean").combine_chunks().flatten().to_numpy().reshape(-1, 3)
    table = signature_table(t.column("key").to_pylist(), part, codes, means, t.column("pixels").to_pylist(),
                            t.column("url_caption").to_pylist(), plan)
    write_ranges(storage, f"{out}.sig.parquet", table, "h32", n_buckets)
    result = {"part": part, "signed": t.num_rows}
    storage.write_json(f"{out}.json", result)     # last: the file above is whole
    return result


# How a partition's own images are described: the thumbnail of the picture without a `border`
# resize's bars (dataplane.pictures), codes and hashes kept for the sign step. Part of each
# partition's reuse key, so a partition described by an earlier version is described again.
WITHIN_DESCRIPTOR = "thumb16-unpadded"
DESCRIBED_LAYOUT = 3        # what a description file holds (3: codes, colours and hashes for the sign step)


def _described_key(fingerprint: str, u) -> str:
    """What decides a partition's descriptions: the stage's fingerprint (config, evaluation sets),
    how images are described and what the file holds, the partition's content. Not the run's size:
    a dataset line that doubles keeps every description (only the cheap signatures follow the band
    plan)."""
    text = json.dumps([fingerprint, WITHIN_DESCRIPTOR, DESCRIBED_LAYOUT, u.part, u.sha256])
    return f"{u.part}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _signed_key(part: str, described: str, plan: BandPlan) -> str:
    """A partition's signatures: its descriptions and the band plan (it grows with N, in steps)."""
    text = json.dumps([described, plan.width, plan.bands, plan.bits])
    return f"{part}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _eval_hit(set_kind: str, sim: float, cfg: DedupConfig) -> bool:
    if not set_kind:
        return False
    kind = set_kind.split("|")[1]
    return sim >= (cfg.eval_threshold if kind == "hash" else cfg.encoder_threshold)


def hamming_radius(threshold: float, bits: int) -> int:
    """Bits two SimHash codes may differ by and still be at cosine >= threshold (generously)."""
    expected = bits * math.acos(min(1.0, threshold)) / math.pi
    return int(2.5 * expected) + 8


DESCRIBED = "dedup/described"    # per partition, by what decided it: kept across runs (Stage.preserve)
SIGNED = "dedup/signed"          # per partition and band plan: kept across runs too
# a signature is (sig_kind, sig_hi, sig_lo): 16 bytes of a pixel or URL+caption hash, or a band's value
SIG_SCHEMA = pa.schema([("sig_kind", pa.int16()), ("sig_hi", pa.uint64()), ("sig_lo", pa.uint64()),
                        ("key", pa.string()), ("part", pa.string()), ("code", pa.binary()),
                        ("mean", pa.list_(pa.float32(), 3)), ("h32", pa.uint32())])


def signature_table(keys: list[str], part: str, codes: np.ndarray, means: np.ndarray, pixels: list[bytes],
                    url_caption: list[bytes], plan: BandPlan) -> pa.Table:
    """A row per (sample, signature), built column-wise: codes (n, bits/8) uint8, means (n, 3), the
    16-byte pixel and URL+caption hashes. Each row carries the sample's code and mean colour, so a
    group task needs nothing else; its bucket is a range of `h32`, a hash of the signature
    (infra/shuffle.py: range buckets, so the file serves whatever number of buckets a later, larger
    run needs)."""
    n, per = len(keys), sigs_per_sample(plan)
    kind = np.repeat(np.arange(per, dtype=np.int16), n)                   # (per * n,) signature-major
    hi, lo = np.zeros(per * n, np.uint64), np.zeros(per * n, np.uint64)
    for k, hashes in ((PIXELS, pixels), (URL_CAPTION, url_caption)):
        h = np.frombuffer(b"".join(hashes), "<u8").reshape(n, 2) if n else np.zeros((0, 2), np.uint64)
        hi[k * n:(k + 1) * n], lo[k * n:(k + 1) * n] = h[:, 0], h[:, 1]
    if n:
        hi[2 * n:] = band_values(codes, plan).ravel()
    with np.errstate(over="ignore"):
        h32 = (mix64(hi ^ mix64(lo ^ kind.astype(np.uint64))) >> np.uint64(32)).astype(np.uint32)
    sample = np.tile(np.arange(n), per)
    return pa.table({"sig_kind": kind, "sig_hi": hi, "sig_lo": lo,
                     "key": pa.array(keys, pa.string()).take(sample),
                     "part": pa.array([part], pa.string()).take(np.zeros(per * n, np.int64)),
                     "code": pa.array([c.tobytes() for c in codes], pa.binary()).take(sample),
                     "mean": pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(means, np.float32).ravel()),
                                                               3).take(sample),
                     "h32": h32}, schema=SIG_SCHEMA)


def _packed(column, width: int) -> np.ndarray:
    """A binary column whose values are all `width` bytes -> (n, width) uint8, without a copy per row."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(arr) == 0:
        return np.zeros((0, width), np.uint8)
    offsets = np.frombuffer(arr.buffers()[1], np.int32)[arr.offset:arr.offset + len(arr) + 1]
    data = np.frombuffer(arr.buffers()[2], np.uint8)[offsets[0]:offsets[-1]]
    return data.reshape(len(arr), width)


PAIR_DIR, EDGE_DIR, DECISIONS = "dedup/_work/pairs", "dedup/_work/edges", "dedup/_work/decisions.parquet"
WANTED_DIR = "dedup/_work/wanted"
# a near candidate's side: its descriptor is wanted by a pair bucket; fetched by the task of its partition's group
WANTED_SCHEMA = pa.schema([("key", pa.string()), ("part", pa.string()), ("pair_bucket", pa.int32()),
                           ("fetch_bucket", pa.int32())])
VEC_SCHEMA = pa.schema([("key", pa.string()), ("vec", pa.binary()), ("pair_bucket", pa.int32())])
PAIR_SCHEMA = pa.schema([("a", pa.string()), ("part_a", pa.string()), ("b", pa.string()), ("part_b", pa.string()),
                         ("kind", pa.string()), ("pair_bucket", pa.int32())])


def _pair_buckets(a: list[str], b: list[str], n: int) -> np.ndarray:
    """A pair's bucket for the verification step: by the pair, so every copy of a pair (found in
    several signature buckets: several bands alike) meets the others in one task."""
    return hash_buckets([f"{x}\0{y}" for x, y in zip(a, b)], n)


def _sig_pieces(storage, files: list[str], n_buckets: int) -> list[pa.Table]:
    """Ray task (the group shuffle's map): a few partitions' signature files, each read once (in
    parallel), cut into the `n_buckets` range buckets for the group tasks (through the object store,
    not the bucket)."""
    return range_pieces(pa.concat_tables(storage.read_tables(files)), "h32", n_buckets)


def _group_reduce(storage, bucket: int, cfg: DedupConfig, n_pair_buckets: int, n_fetch: int,
                  *pieces: pa.Table) -> dict:
    """Ray task (the group shuffle's reduce): one signature bucket's pieces from every partition."""
    return _group_rows(storage, bucket, cfg, pa.concat_tables(pieces) if pieces else SIG_SCHEMA.empty_table(),
                       n_pair_buckets, n_fetch)


def _group_task(storage, bucket: int, cfg: DedupConfig, files: list[str], n_buckets: int, n_pair_buckets: int) -> dict:
    """One signature bucket read from the signature files themselves (`benchmarks/dedup_within.py`
    runs the group step alone this way)."""
    return _group_rows(storage, bucket, cfg, read_range(storage, files, "h32", bucket, n_buckets, SIG_SCHEMA),
                       n_pair_buckets)


def _group_rows(storage, bucket: int, cfg: DedupConfig, t: pa.Table, n_pair_buckets: int,
                n_fetch: int | None = None) -> dict:
    """One signature bucket -> its pairs (a < b, with their partitions and kind), written to one file
    bucketed by pair (infra/shuffle.py); -> counts. Equal exact signatures pair every member with the
    group's smallest key; equal band values pair the members whose codes are within the Hamming
    radius and whose colours agree (stages/lsh.py), the whole group, never cut."""
    t = t.sort_by([("sig_kind", "ascending"), ("sig_hi", "ascending"), ("sig_lo", "ascending"), ("key", "ascending")])
    kind, hi, lo = (t.column(c).to_numpy() for c in ("sig_kind", "sig_hi", "sig_lo"))
    starts, lengths = runs(kind, hi, lo)
    exact = (kind[starts] < 2) & (lengths > 1)
    firsts = np.repeat(starts[exact], lengths[exact] - 1)
    ex_i, ex_j = [firsts], [firsts + _ranks(lengths[exact] - 1)]
    near = (kind[starts] >= 2) & (lengths > 1)
    largest = int(lengths[near].max()) if near.any() else 0
    nr_i, nr_j = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    if near.any():
        codes = _packed(t.column("code"), cfg.bits // 8)
        means = t.column("mean").combine_chunks().flatten().to_numpy().reshape(-1, 3)
        g_starts, g_lengths, rows = starts[near], lengths[near], None
        if (g_lengths > SMALL_GROUP).any():      # exact copies (placeholders) paired linearly, then searched once
            rows, g_starts, g_lengths, copy_i, copy_j = collapse_copies(codes, means, g_starts, g_lengths)
            nr_i.append(copy_i)
            nr_j.append(copy_j)
            codes, means = codes[rows], means[rows]
        for i, j in close_in_groups(codes, means, g_starts, g_lengths, hamming_radius(cfg.within_threshold, cfg.bits),
                                    cfg.colour_tol, BLOCK):
            nr_i.append(i if rows is None else rows[i])
            nr_j.append(j if rows is None else rows[j])
    pairs = set()
    for i_list, j_list, what in ((ex_i, ex_j, "exact_duplicate"), (nr_i, nr_j, "near_duplicate")):
        i, j = np.concatenate(i_list).astype(np.int64), np.concatenate(j_list).astype(np.int64)
        # only the rows in a pair become Python strings
        ka, pa_, kb, pb = (t.column(c).take(x).to_pylist() for x in (i, j) for c in ("key", "part"))
        pairs |= {Pair(*p, what) for p in zip(ka, pa_, kb, pb)}
    rows = sorted(pairs)
    cols = {f: [getattr(p, f) for p in rows] for f in Pair._fields}
    pair_bucket = _pair_buckets(cols["a"], cols["b"], n_pair_buckets)
    table = pa.table({**cols, "pair_bucket": pa.array(pair_bucket, pa.int32())}, schema=PAIR_SCHEMA)
    if rows:            # no empty files: the driver passes on the names of those written
        write_buckets(storage, f"{PAIR_DIR}/{bucket:06d}.parquet", table, "pair_bucket")
    # each near candidate's two descriptors, asked of the partitions that hold them (a join, not a
    # task reading every partition's descriptors)
    wanted = sorted({(k, part, int(pb)) for p, pb in zip(rows, pair_bucket) if p.kind == "near_duplicate"
                     for k, part in ((p.a, p.part_a), (p.b, p.part_b))})
    if wanted:
        write_buckets(storage, f"{WANTED_DIR}/{bucket:06d}.parquet", pa.table({
            "key": [w[0] for w in wanted], "part": [w[1] for w in wanted], "pair_bucket": pa.array([w[2] for w in wanted], pa.int32()),
            "fetch_bucket": pa.array(hash_buckets([w[1] for w in wanted], n_fetch or n_pair_buckets))},
            schema=WANTED_SCHEMA), "fetch_bucket")
    return {"pairs": len(rows), "wanted": len(wanted), "largest_group": largest, "rows": t.num_rows}


MAP_SIGNATURES = 2_000_000   # signature rows a group map task holds (~70 bytes each)
FETCH_PARTS = 512      # partitions whose descriptors one fetch task reads, at most, where CPUs allow (each reads every wanted file)
FETCH_AT_ONCE = 32     # descriptor files a fetch task reads at once (each waits on the store's latency)


def _fetch_pieces(storage, bucket: int, files: list[str], desc: dict[str, str], n_pairs: int) -> list[pa.Table]:
    """Ray task (the verify shuffle's map): the descriptors wanted of one group of partitions (each
    partition's file read once) -> a piece per pair bucket, handed to the verify tasks through Ray's
    object store."""
    t = read_bucket(storage, files, "fetch_bucket", bucket, WANTED_SCHEMA)
    by_part: dict[str, list] = {}
    for k, part, pb in zip(*(t.column(c).to_pylist() for c in ("key", "part", "pair_bucket"))):
        by_part.setdefault(part, []).append((k, pb))
    out = {"key": [], "vec": [], "pair_bucket": []}
    parts = sorted(by_part)
    for lo in range(0, len(parts), FETCH_AT_ONCE):     # read in parallel, a group at a time (memory: a group)
        group = parts[lo:lo + FETCH_AT_ONCE]
        for part, d in zip(group, storage.read_tables([desc[q] for q in group], ["key", "vec"])):
            want = by_part[part]
            d = d.filter(pc.is_in(d.column("key"), pa.array(sorted({k for k, _ in want}))))
            vec = dict(zip(d.column("key").to_pylist(), d.column("vec").to_pylist()))
            for k, pb in want:
                out["key"].append(k)
                out["vec"].append(vec[k])
                out["pair_bucket"].append(pb)
    table = pa.table(out, schema=VEC_SCHEMA)
    return bucket_pieces(table, np.asarray(out["pair_bucket"], np.int64), n_pairs)


def _ranks(counts: np.ndarray) -> np.ndarray:
    """1..c for each c in counts, concatenated: a run member's place after the run's first."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(counts)
    return np.arange(total) - np.repeat(ends - counts, counts) + 1


EDGE_SCHEMA = pa.schema([("a", pa.string()), ("part_a", pa.string()), ("b", pa.string()), ("part_b", pa.string()),
                         ("kind", pa.string()), ("cosine", pa.float64())])


def _unit(v: bytes) -> np.ndarray:
    x = np.frombuffer(v, np.float16).astype(np.float32)
    return x / (np.linalg.norm(x) + 1e-6)


def _verify_reduce(storage, bucket: int, files: list[str], threshold: float, *pieces: pa.Table) -> dict:
    """Ray task (the verify shuffle's reduce): one pair bucket from every group file, and its
    candidates' descriptors from every fetch task -> its exact pairs and its candidate near pairs at
    cosine >= threshold (a pair also found exact is exact), written as edges; -> counts."""
    t = read_bucket(storage, files, "pair_bucket", bucket, PAIR_SCHEMA)
    pairs = sorted({Pair(*r) for r in zip(*(t.column(f).to_pylist() for f in Pair._fields))})
    exact = [p for p in pairs if p.kind == "exact_duplicate"]
    exact_ab = {(p.a, p.b) for p in exact}
    cand = [p for p in pairs if p.kind == "near_duplicate" and (p.a, p.b) not in exact_ab]
    v = pa.concat_tables(pieces) if cand and pieces else VEC_SCHEMA.empty_table()
    vec = {k: _unit(x) for k, x in zip(v.column("key").to_pylist(), v.column("vec").to_pylist())}
    near = [(p, c) for p in cand if (c := float(vec[p.a] @ vec[p.b])) >= threshold]
    edges = [(p, None) for p in exact] + near
    if edges:
        storage.write_table(f"{EDGE_DIR}/{bucket:06d}.parquet", pa.table(
            {**{f: [getattr(p, f) for p, _ in edges] for f in Pair._fields}, "cosine": [c for _, c in edges]},
            schema=EDGE_SCHEMA))
    return {"exact": len(exact), "candidates": len(cand), "near": len(near), "edges": len(edges)}


def component_roots(ia: np.ndarray, ib: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Connected components of the graph whose edges are (ia[i], ib[i]) over nodes 0..len(rank)-1;
    -> each node's root: the node of lowest `rank` in its component (column-wise: int arrays and
    scipy's components, no Python object per node)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    n = len(rank)
    graph = coo_matrix((np.ones(len(ia), np.int8), (ia, ib)), shape=(n, n)).tocsr()
    _, labels = connected_components(graph, directed=False)
    lowest = np.full(labels.max() + 1 if n else 0, n, np.int64)
    np.minimum.at(lowest, labels, rank)
    by_rank = np.empty(n, np.int64)
    by_rank[rank] = np.arange(n)
    return by_rank[lowest[labels]]


DECISION_SCHEMA = pa.schema([("key", pa.string()), ("reason", pa.string()), ("score", pa.float64()),
                             ("root", pa.string()), ("part", pa.int32())])


def _components_task(storage, files: list[str], parts: list[str], shown_per_reason: int,
                     line_shards: frozenset = frozenset(), published_parts: frozenset = frozenset()) -> dict:
    """Ray task: every edge (exact pairs, verified near pairs) joined into clusters; of each the
    smallest key is kept, or, in a dataset line (stages/line.py), the samples it published (they
    are in shards already and stay kept; a new copy of one is the duplicate). Writes each dropped
    key's (reason, cosine, key kept) in one file, a row group per partition (its index in `parts`),
    for the partitions' tasks to read; -> per-partition counts and the first few drops of each
    reason (by key) for the report. Column-wise: its memory is a few arrays per key in an edge
    (~60 bytes each), growing with the duplicates, never with the data; the driver gets counts."""
    from .line import published_mask

    t = pa.concat_tables(storage.read_tables(files)) if files else EDGE_SCHEMA.empty_table()
    n_e = t.num_rows
    enc = pc.dictionary_encode(pa.concat_arrays([t.column("a").combine_chunks(), t.column("b").combine_chunks()]))
    ends, keys = enc.indices.to_numpy().astype(np.int32), enc.dictionary
    del enc
    ia, ib = ends[:n_e], ends[n_e:]
    n = len(keys)
    part = np.zeros(n, np.int32)           # a key lies in one partition
    part_index = pa.array(parts, pa.string())
    for col, idx in (("part_a", ia), ("part_b", ib)):
        part[idx] = pc.index_in(t.column(col), part_index).to_numpy(zero_copy_only=False)
    is_exact = pc.equal(t.column("kind"), "exact_duplicate").to_numpy(zero_copy_only=False)
    cos = pc.fill_null(t.column("cosine"), -1.0).to_numpy(zero_copy_only=False)
    del t                                  # from here on: integer and float arrays, and the keys once
    pub_parts = sorted({parts[i] for i in np.unique(part)} & published_parts)
    published = published_mask(storage, pub_parts, keys, line_shards) if pub_parts else np.zeros(n, bool)
    by_key = np.empty(n, np.int64)
    by_key[pc.sort_indices(keys).to_numpy()] = np.arange(n)
    rank = np.empty(n, np.int64)           # published samples first, then by key
    rank[np.lexsort((by_key, ~published))] = np.arange(n)
    roots = component_roots(ia, ib, rank)
    exact = np.zeros(n, bool)
    for idx in (ia, ib):
        exact[idx[is_exact]] = True
    best = np.full(n, -1.0)
    near = ~is_exact
    for idx in (ia, ib):
        np.maximum.at(best, idx[near], cos[near])
    drop = np.flatnonzero((roots != np.arange(n)) & ~published)
    drop = drop[np.argsort(by_key[drop])]          # by key
    table = pa.table({"key": keys.take(pa.array(drop, pa.int64())),
                      "reason": pc.if_else(pa.array(exact[drop]), "exact_duplicate", "near_duplicate"),
                      "score": pa.array(np.where(exact[drop], np.nan, best[drop]), pa.float64(), from_pandas=True),
                      "root": keys.take(pa.array(roots[drop], pa.int64())),
                      "part": pa.array(part[drop], pa.int32())}, schema=DECISION_SCHEMA)
    if len(drop):
        write_buckets(storage, DECISIONS, table, "part")
    per_part = {parts[i]: int(c) for i, c in enumerate(np.bincount(part[drop], minlength=len(parts))) if c}
    shown: dict[str, list] = {}
    for why, mask in (("exact_duplicate", exact[drop]), ("near_duplicate", ~exact[drop])):
        for k in drop[mask][:shown_per_reason]:
            shown.setdefault(why, []).append((keys[k].as_py(), None if exact[k] else float(best[k]),
                                              keys[roots[k]].as_py(), parts[part[k]], parts[part[roots[k]]]))
    # what decides each partition's verdicts besides its own descriptors: a partition whose input,
    # descriptors and decisions are those of an earlier run is not judged again (a part at a time)
    by_part = table.sort_by([("part", "ascending"), ("key", "ascending")])
    digests, bounds = {}, np.flatnonzero(np.diff(by_part.column("part").to_numpy())) + 1
    for lo, hi in zip([0, *bounds], [*bounds, by_part.num_rows]):
        if hi > lo:
            piece = by_part.slice(lo, hi - lo)
            rows = zip(*(piece.column(c).to_pylist() for c in ("key", "reason", "score", "root")))
            digests[parts[piece.column("part")[0].as_py()]] = hashlib.sha256(
                json.dumps(list(rows)).encode()).hexdigest()[:24]
    return {"duplicates": len(drop), "per_part": per_part, "shown": shown, "digests": digests,
            "published_kept": int((published & (roots != np.arange(n))).sum())}


CAPTIONS = "dedup/eval_captions.parquet"    # the evaluation sets' captions, for the verdict tasks


def _eval_captions(storage, cfg: DedupConfig, run_dir: Path | None = None) -> tuple[str, str, int] | None:
    """The evaluation sets' captions in one file the verdict tasks read: -> (its path, digest, how
    many), or None when no set has captions or matching is off."""
    from .eval_sets import iter_captions

    if cfg.caption_match == "off":
        return None
    rows = [(es.name, i, c) for es in cfg.eval_sets for i, c in iter_captions(es, run_dir)]
    if not rows:
        return None
    t = pa.table({"set": [r[0] for r in rows], "id": [r[1] for r in rows], "caption": [r[2] for r in rows]})
    digest = storage.write_table(CAPTIONS, t)[0][:16]
    return CAPTIONS, digest, len(rows)


def _caption_index(storage, captions: tuple, cfg: DedupConfig):
    from .caption_match import CaptionIndex

    index = CaptionIndex(ngram=cfg.caption_ngram, min_words=cfg.caption_min_words)
    t = storage.read_table(captions[0])
    for s, i, c in zip(*(t.column(x).to_pylist() for x in ("set", "id", "caption"))):
        index.add(s, i, c)
    return index


def _verdicts(table: pa.Table, part: str, index: int, has_decisions: bool, cfg: DedupConfig,
              storage=None, desc: str = "", removals: str | None = None,
              captions: tuple | None = None) -> tuple[pa.Table, dict]:
    """A partition's verdicts: undecodable, removed from the dataset line (`removals`: the line
    records some), evaluation-set matches, then its within-data duplicates (its row group of the
    components task's file)."""
    desc = storage.read_table(desc, ["key", "ok", "eval_set", "eval_id", "eval_sim"] + (["vec"] if removals else []))
    removed = {}
    if removals:
        from .removals import blocked

        removed = blocked(storage, table, dict(zip(desc.column("key").to_pylist(), desc.column("vec").to_pylist())))
        desc = desc.drop_columns(["vec"])
    info = {k: (o, s, i, sim) for k, o, s, i, sim in zip(*(desc.column(c).to_pylist() for c in desc.column_names))}
    decisions = {}
    if has_decisions:
        d = read_bucket(storage, [DECISIONS], "part", index, DECISION_SCHEMA)
        decisions = {k: (r, s, root) for k, r, s, root in zip(*(d.column(c).to_pylist()
                                                                  for c in ("key", "reason", "score", "root")))}
    out = {c: [] for c in ("key", "verdict", "reason", "score", "detail", "match_set", "match_key")}
    evals: dict[str, int] = {}

    def add(k, v, r="", s=None, d="", match_set=None, match_key=None):
        for c, x in zip(out, (k, v, r, s, d, match_set, match_key)):
            out[c].append(x)

    matcher = _caption_index(storage, captions, cfg) if captions else None
    alt = table.column("caption").to_pylist() if matcher and "caption" in table.column_names else None
    hits: dict[str, int] = {}
    for n, k in enumerate(table.column("key").to_pylist()):
        ok, set_kind, eval_id, sim = info[k]
        said = matcher.match(alt[n]) if alt is not None else None
        if said:
            hits[said[0]] = hits.get(said[0], 0) + 1
        if not ok:
            add(k, DROPPED, "undecodable_image", d="could not be described")
        elif k in removed:
            add(k, DROPPED, "removed", d=removed[k], match_set="removal")
        elif _eval_hit(set_kind, sim, cfg):
            name, kind = set_kind.split("|")
            add(k, DROPPED, "eval_duplicate", float(sim), f"matches {name}:{eval_id} ({kind})", name, str(eval_id))
            evals[name] = evals.get(name, 0) + 1
        elif said and cfg.caption_match == "drop":
            add(k, DROPPED, "eval_caption", d=f"alt-text holds {said[0]}:{said[1]}'s caption ({said[2]})",
                match_set=said[0], match_key=said[1])
        elif k in decisions:
            reason, score, root = decisions[k]
            add(k, DROPPED, reason, score, f"duplicate_of={root}", match_key=root)
        elif said:      # flagged: kept, its row naming the caption
            add(k, KEPT, d=f"flag: alt-text holds {said[0]}:{said[1]}'s caption ({said[2]})",
                match_set=said[0], match_key=said[1])
        else:
            add(k, KEPT)
    return pa.table(out, schema=pa.schema([("key", pa.string()), ("verdict", pa.string()), ("reason", pa.string()),
                                           ("score", pa.float64()), ("detail", pa.string()), ("match_set", pa.string()),
                                           ("match_key", pa.string())])), {"eval_matches": evals,
                                                                           **({"caption_matches": hits} if hits else {})}


@dataclass
class Candidates:
    """What the workers found, as counts (the pairs stay in the run folder: dedup/_work/edges) and
    the evaluation sets' statistics."""
    exact: int
    near: int
    n_candidates: int
    edge_files: list
    set_stats: dict
    largest_group: int = 0        # the most codes one LSH band value held (compared in full, never cut)
    buckets: int = 0              # group tasks, and verification tasks
    lsh: str = ""                 # the band plan for this N, and its expected recall at the threshold
    desc: dict = field(default_factory=dict)   # partition -> its descriptors' file
    reduce_tasks: dict = field(default_factory=dict)


class DedupStage(Decide):
    name = "dedup"
    config_key, config_class = "dedup", DedupConfig
    reasons = ("exact_duplicate", "near_duplicate", "eval_duplicate", "undecodable_image", "removed", "eval_caption")
    report = "dedup/report.html"
    # partitions described, and examples picked, before: by what decided them (a scheduled run's reuse)
    preserve = ("described", "signed", "examples", "reuse")
    audits = (("eval_near_copy", "eval_duplicate"), ("repeat_row", "exact_duplicate"), ("train_near_copy", ""),
              ("eval_caption", "eval_caption"))

    def preflight(self, config) -> None:
        preflight(config.stages.dedup, None)
        for es in config.stages.dedup.eval_sets:
            if es.kind == "builtin" and es.path == "demo_heldout" and config.source.kind != "synthetic":
                raise UserError(f"stages.dedup.eval_sets: {es.name} (builtin demo_heldout) exists only for "
                                "source.kind synthetic; remove it or list your own evaluation sets")

    def fingerprint(self, config) -> str:
        # the evaluation sets' content decides the result as much as their config
        from .eval_sets import stat_fingerprint

        cfg = self.section(config)
        base = json.loads(super().fingerprint(config))
        return json.dumps(base, sort_keys=True) + "".join(
            sorted(f"{e.name}:{stat_fingerprint(e)}" for e in cfg.eval_sets))

    def measure(self, ctx: StageContext) -> Candidates:
        """Workers describe every image, search the evaluation sets, and group signatures by bucket;
        candidate near pairs are verified by exact cosine."""
        import ray

        cfg: DedupConfig = ctx.cfg
        for es in cfg.eval_sets:
            check_exists(es, ctx.run_dir)
        cache = Path(cfg.cache_dir).expanduser()
        params = {"descriptor": "thumb16-v2", "bits": cfg.bits, "colour_tol": cfg.colour_tol}
        index_paths, enc_paths, set_stats = {}, {}, {}
        for es in cfg.eval_sets:
            path, st = build_reference(es, ctx.run_dir, cache, params, log=ctx.log, run=ctx.run)
            index_paths[es.name], set_stats[es.name] = path, st
            if cfg.encoder_checkpoint:
                enc_params = {"descriptor": "encoder", "checkpoint": _dir_digest(cfg.encoder_checkpoint),
                              "bits": cfg.bits, "colour_tol": None, "image_size": cfg.encoder_image_size}
                epath, _ = build_reference(es, ctx.run_dir, cache, enc_params, log=ctx.log,
                                           describer=EncoderDescriber(cfg.encoder_checkpoint, cfg.encoder_image_size,
                                                                                      cfg.encoder_sha256))
                enc_paths[es.name] = epath
        encoder_rel = None
        if cfg.encoder_checkpoint:
            encoder_rel = "dedup/_work/encoder"
            src = Path(cfg.encoder_checkpoint)
            if src.is_file():   # a TorchScript file: its folder's copy holds just it
                ctx.storage.write_bytes(f"{encoder_rel}/{src.name}", src.read_bytes())
            else:
                ctx.storage.put_dir(encoder_rel, cfg.encoder_checkpoint)
        upstream = [u for u in ctx.upstream or []]
        samples = sum(u.kept for u in upstream)
        plan = band_plan(samples, cfg.within_threshold, cfg.bits)
        n_buckets = bucket_count(samples, cfg.bucket_rows, ctx.cluster_cpus(), sigs_per_sample(plan))
        # one copy in the object store, shared by every task on a node (a path here means nothing there)
        blobs = ray.put({"hash": {n: NearDupIndex.load(p).arrays() for n, p in index_paths.items()},
                         "encoder": {n: NearDupIndex.load(p).arrays() for n, p in enc_paths.items()}})
        names = tuple(sorted(p.name for p in [*index_paths.values(), *enc_paths.values()]))
        args = (blobs, names, encoder_rel)
        # a partition described by an earlier run with the same input and config is reused (a
        # scheduled run that added 1 % describes the 1 %), whatever the run's size
        described, outs = reused_or_run(
            ctx, _describe_task, DESCRIBED, lambda u: _described_key(ctx.fingerprint, u),
            lambda u, out: (ctx.storage, u.part, u.file, *args, cfg, out), "dedup describe",
            "described before with the same input", "describe", num_cpus=cfg.cpus_per_worker)
        ctx.log(f"dedup: described {sum(d['described'] for d in described)} images")
        # signatures for this size's band plan: a partition signed before under the same plan is
        # reused; its file serves any bucket count (range buckets)
        _, signed = reused_or_run(
            ctx, _sign_task, SIGNED, lambda u: _signed_key(u.part, outs[u.part], plan),
            lambda u, out: (ctx.storage, u.part, f"{outs[u.part]}.desc.parquet", cfg, plan, n_buckets, out),
            "dedup sign", f"signed before for {plan.bands} bands of {plan.width} bits", "sign",
            num_cpus=cfg.cpus_per_worker)
        # pairs are few next to signatures: fewer pair buckets, so the fetch and verify tasks each
        # open the group tasks' files n_buckets / PAIR_FAN_IN times fewer
        n_pairs = max(1, math.ceil(n_buckets / PAIR_FAN_IN))
        # the near candidates' descriptors are fetched by partition: a task per FETCH_PARTS
        # partitions at least (one task reading 2,000 partitions' files took 11 s of an append)
        n_fetch = max(n_pairs, min(int(ctx.cluster_cpus()), math.ceil(len(upstream) / FETCH_PARTS)))
        # each partition's signatures read once and handed to the group tasks through Ray's object
        # store: a group task opens no file (it opened every signature file, or merged copies of them);
        # a map task reads several partitions' files, up to MAP_SIGNATURES rows
        files = [f"{signed[u.part]}.sig.parquet" for u in upstream]
        maps = map_groups([u.kept * sigs_per_sample(plan) for u in upstream], MAP_SIGNATURES, int(ctx.cluster_cpus()))
        found = ctx.shuffle(_sig_pieces, [(ctx.storage, [files[i] for i in g], n_buckets) for g in maps],
                            n_buckets, _group_reduce, [(ctx.storage, b, cfg, n_pairs, n_fetch) for b in range(n_buckets)],
                            "dedup group", num_cpus=cfg.cpus_per_worker)
        # only the files written (no empty ones): a reducer opens just those
        pair_files = [f"{PAIR_DIR}/{b:06d}.parquet" for b, f in enumerate(found) if f["pairs"]]
        wanted_files = [f"{WANTED_DIR}/{b:06d}.parquet" for b, f in enumerate(found) if f["wanted"]]
        desc = {p: f"{o}.desc.parquet" for p, o in outs.items()}
        # the candidates' descriptors, fetched by partition, reach the verify task of their pair
        # bucket through Ray's object store (no file between them)
        checked = ctx.shuffle(_fetch_pieces, [(ctx.storage, b, wanted_files, desc, n_pairs) for b in range(n_fetch)]
                              if wanted_files else [], n_pairs, _verify_reduce,
                              [(ctx.storage, b, pair_files, cfg.within_threshold) for b in range(n_pairs)],
                              "dedup verify", num_cpus=cfg.cpus_per_worker) if pair_files else []
        edge_files = [f"{EDGE_DIR}/{b:06d}.parquet" for b, c in enumerate(checked) if c["edges"]]
        return Candidates(sum(c["exact"] for c in checked), sum(c["near"] for c in checked),
                          sum(c["candidates"] for c in checked), edge_files,
                          set_stats, max((f["largest_group"] for f in found), default=0), n_buckets,
                          plan.describe(cfg.within_threshold), desc,
                          {"group": n_buckets, "fetch": n_fetch if wanted_files and pair_files else 0, "verify": len(checked)})

    def decide(self, ctx: StageContext, found: Candidates) -> dict:
        """Pairs joined into clusters, in a task; of each the smallest key is kept. -> counts per
        partition and a few drops to show (the decisions themselves stay in the run folder)."""
        from .dedup_report import PAIRS_PER_REASON

        from .line import published_parts, read_line

        parts = sorted(u.part for u in ctx.upstream or [])
        line = read_line(ctx.storage)      # an append-only dataset line: what it published stays kept
        shards = frozenset(s["name"] for s in line["shards"]) if line else frozenset()
        pub = frozenset(published_parts(ctx.storage) & set(parts)) if line else frozenset()
        out = ctx.call(_components_task, ctx.storage, found.edge_files, parts, PAIRS_PER_REASON, shards, pub,
                       what="dedup components", num_cpus=ctx.cfg.cpus_per_worker)
        ctx.log(f"dedup: {found.exact} exact pairs, {found.n_candidates} near candidates, {found.near} "
                f"near pairs, {out['duplicates']} within-data duplicates"
                + (f"; {out['published_kept']} published sample(s) of this dataset line kept beside the one "
                   "their cluster keeps" if out["published_kept"] else ""))
        return out

    def apply(self, ctx: StageContext, found: Candidates, decisions: dict) -> StageResult:
        from .removals import DESCRIPTIONS, removal_digest

        cfg: DedupConfig = ctx.cfg
        index = {p: i for i, p in enumerate(sorted(u.part for u in ctx.upstream or []))}
        # where each partition's descriptions are: `capline remove` matches images against them
        ctx.storage.write_json(DESCRIPTIONS, dict(sorted(found.desc.items())))
        # a dataset line's removals: what they name never comes back (pipeline/remove.py)
        removals = removal_digest(ctx.storage)
        captions = _eval_captions(ctx.storage, cfg, ctx.run_dir)
        tasks = [PartTask(u.part, u.file, u.part,
                          kwargs={"part": u.part, "index": index[u.part], "has_decisions": u.part in decisions["per_part"],
                                  "cfg": cfg, "storage": ctx.storage, "desc": found.desc[u.part],
                                  "removals": removals, "captions": captions},
                          input_sha=u.sha256, depends=f"{found.desc[u.part]}:{decisions['digests'].get(u.part, '')}"
                                                      + (f":{removals}" if removals else "")
                                                      + (f":{captions[1]}" if captions else ""))
                 for u in ctx.upstream or []]
        parts = ctx.map_parts(_verdicts, tasks, num_cpus=0.5, reuse=True)
        from .dedup_report import write_report

        ctx.log(f"dedup: pairs side by side in {write_report(ctx, decisions['shown'], parts)}")
        evals: dict[str, int] = {}
        caption_hits: dict[str, int] = {}
        for p in parts:
            for name, c in p.extra.get("eval_matches", {}).items():
                evals[name] = evals.get(name, 0) + c
            for name, c in p.extra.get("caption_matches", {}).items():
                caption_hits[name] = caption_hits.get(name, 0) + c
        return StageResult(parts, {"eval_sets": found.set_stats, "eval_matches": evals,
                                   "caption_matches": {"mode": cfg.caption_match, "captions": captions[2] if captions else 0,
                                                       "by_set": caption_hits},
                                   "largest_lsh_group": found.largest_group,
                                   "reduce_tasks": found.reduce_tasks,
                                   "published_kept": decisions.get("published_kept", 0),
                                   "pairs": {"exact": found.exact, "near_candidates": found.n_candidates,
                                             "near": found.near},
                                   "method": {"descriptor": WITHIN_DESCRIPTOR, "eval_threshold": cfg.eval_threshold,
                                              "within_threshold": cfg.within_threshold,
                                              "lsh": f"{found.lsh}, Hamming radius "
                                                     f"{hamming_radius(cfg.within_threshold, cfg.bits)}",
                                              "encoder_checkpoint": cfg.encoder_checkpoint}},
                           artifacts={"report": "dedup/report.html"})


def _dir_digest(path: str) -> str:
    h = hashlib.sha256()
    if Path(path).is_file():
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    for f in sorted(Path(path).glob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def preflight(cfg: DedupConfig, run_dir: Path | None) -> None:
    for es in cfg.eval_sets:
        if es.kind == "builtin" and es.path == "demo_heldout":
            continue  # made by the source stage of this very run
        check_exists(es, run_dir)
    # what validation accepts, run accepts: a capline model folder, or TorchScript (pinned, checked there)
    if cfg.encoder_checkpoint and torchscript_file(cfg.encoder_checkpoint) is None \
            and not (Path(cfg.encoder_checkpoint) / "model.json").is_file():
        raise UserError(f"stages.dedup.encoder_checkpoint {cfg.encoder_checkpoint}: neither a capline model checkpoint "
                        f"(a folder with model.json) nor a TorchScript file ({', '.join(TORCHSCRIPT)})")
