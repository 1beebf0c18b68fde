"""The dedup stage's settings (`stages.dedup`), checked with errors that name the setting, and its preflight."""
from __future__ import annotations

import hashlib
import math
from typing import ClassVar
from dataclasses import dataclass, field
from pathlib import Path

from infra.configtools import join, require
from infra.errors import UserError
from infra.hashing import hash_file as file_sha256

from .eval_sets import EvalSetConfig, check_exists


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
    # two training images the thumbnail joined must also reach this cosine of their 24x24 grey
    # thumbnails (imagehash.detail), which tells apart distinct pictures of one kind (products shot
    # alike, icons of a set) and keeps re-hosted copies (resized, re-encoded: photos' and products'
    # all, drawings' 98 %; benchmarks/dedup_real.py); 0 turns it off
    within_detail_threshold: float = 0.99
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
    # evaluation captions in alt-text (stages/dedup/caption_match.py): drop the sample, flag it (kept, its
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
        require(0 <= self.within_detail_threshold <= 1, join(prefix, "within_detail_threshold"),
                f"a cosine threshold in [0, 1] (0: no detail check), got {self.within_detail_threshold}")
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


def torchscript_file(path) -> Path | None:
    """The TorchScript file `path` names: itself, or the one a copied folder holds."""
    p = Path(path)
    if p.is_file() and p.suffix in TORCHSCRIPT:
        return p
    found = sorted(f for f in p.glob("*") if f.suffix in TORCHSCRIPT) if p.is_dir() and not (p / "model.json").is_file() else []
    return found[0] if found else None


def hamming_radius(threshold: float, bits: int) -> int:
    """Bits two SimHash codes may differ by and still be at cosine >= threshold (generously)."""
    expected = bits * math.acos(min(1.0, threshold)) / math.pi
    return int(2.5 * expected) + 8


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


def eval_hit(set_kind: str, sim: float, cfg: DedupConfig) -> bool:
    """Whether a description's best evaluation match ("<set>|hash" or "<set>|encoder", its cosine)
    is within the threshold of its kind: such a sample is dropped, and not searched within the data."""
    if not set_kind:
        return False
    kind = set_kind.split("|")[1]
    return sim >= (cfg.eval_threshold if kind == "hash" else cfg.encoder_threshold)

