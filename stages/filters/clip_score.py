"""The CLIP-score stage: keep image-caption pairs whose embeddings agree.

The score is the cosine of the image and caption embeddings of a scorer (stages/filters/scorer.py):
- `scorer: checkpoint`: a capline CLIP* / SigLIP / CoCa checkpoint folder (and its tokenizer);
- `scorer: bootstrap`: a small CLIP* trained here, first, on a trusted subset
  (`bootstrap.trusted_keys`) or on this stage's own input (deduplicated, language-filtered data).
Scoring runs as a Ray task per partition, reading its images through the sample index; each worker
process loads the scorer once and scores on CPU or GPU (`device`), writing `_work/scores/<part>`.

What is kept: score >= `threshold` (LAION: 0.28 with CLIP B/32), or the top `keep_fraction` of every
score of the stage (DataComp: top 30 %), ties broken by key (the smaller wins). Scores are rounded
to 1e-6 first, so the last bits of a float sum cannot change a verdict, and so a score is one of
2,000,001 values: the cut is an exact distributed quantile, from the partitions' counts per value,
and only the keys tied at the cut value come to the driver. Dropped samples get
reason `clip_score` with the score and the cut in the detail. Stats name the scorer, its checksum,
the cut and a histogram of scores.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections import Counter
from typing import ClassVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from infra.configtools import join, require
from infra.errors import UserError

from ..base import DROPPED, KEPT, Decide, PartTask, StageContext, StageResult
from ..dataplane import PICTURE_COLUMNS, by_location, first_in_seeded_order, picture_batches, pictures, read_images, read_kept, reused_or_run
from ..examples import write_examples
from ..shared_model import TORCH_MB, WORKER_MB, SharedModel
from .scorer import (FOLDS, BootstrapConfig, CrossFitScorer, Scorer, check_scorer, fold_dir, fold_of, read_trusted_keys,
                     small_bootstrap, train_bootstrap)


@dataclass
class ClipScoreConfig:
    # how the work is cut or run, never what is decided: left out of the fingerprint and the card
    HOW: ClassVar[tuple] = ("cpus_per_worker", "gpus_per_worker")
    REMOVED: ClassVar[dict] = {"num_workers": "the executor sizes parallelism from the cluster's CPUs",
                               "batch_size": "never read: tasks size their image batches by rows and bytes"}
    enabled: bool = True  # false: every sample passes this stage
    scorer: Literal["bootstrap", "checkpoint", "hf", "column"] = "bootstrap"  # what scores image-text pairs: bootstrap (trained here), checkpoint, hf (a local CLIP), column (the list's own)
    # scorer: checkpoint -> a capline clip/siglip/coca model folder; scorer: hf -> a local Hugging
    # Face CLIP folder (OpenAI's ViT-B/32 or ViT-L/14 as `save_pretrained` writes them), offline
    checkpoint: str | None = None
    # scorer: column -> a score the URL list already holds (LAION's `similarity`, DataComp's
    # `clip_b32_similarity_score`), carried in by source.keep_columns; a sample without it scores -1
    column: str | None = None
    tokenizer: str | None = None      # default: <checkpoint>/spm.model
    threshold: float | None = None    # keep score >= threshold ...
    keep_fraction: float | None = 0.3  # ... or the top fraction (DataComp's best: 30 %); set one of them
    # what keep_fraction is a fraction of: kept (the samples that reach this stage) or pool (every row
    # the list names, as DataComp defines its baselines: its score column, whether or not a row
    # downloads or passes the filters before; scorer: column only)
    keep_fraction_of: Literal["kept", "pool"] = "kept"
    # a dataset line's cut: keep_fraction's cut as its first run computed it (the score and the
    # last key kept at it), so a later run keeps what that one kept and judges new samples alike;
    # false recomputes the quantile over every sample each run (earlier verdicts may change)
    reuse_cut: bool = False
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    cpus_per_worker: float = 0.75    # < 1 leaves room for the tasks that read partitions
    gpus_per_worker: float = 0.0  # GPUs a scoring task asks Ray for (0: CPU)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # where a scorer runs: auto (a GPU if the task has one), cpu, cuda
    examples_per_reason: int = 20  # samples per drop reason shown in the stage's report
    def validate(self, prefix: str) -> None:
        require((self.threshold is None) != (self.keep_fraction is None), join(prefix, "threshold"),
                "set exactly one of threshold and keep_fraction (set the other to null)")
        if self.keep_fraction is not None:
            require(0 < self.keep_fraction <= 1, join(prefix, "keep_fraction"),
                    f"must be in (0, 1], got {self.keep_fraction}")
        if self.threshold is not None:
            require(-1 <= self.threshold <= 1, join(prefix, "threshold"), f"a cosine in [-1, 1], got {self.threshold}")
        if self.scorer in ("checkpoint", "hf"):
            require(bool(self.checkpoint), join(prefix, "checkpoint"),
                    "scorer: checkpoint needs the checkpoint folder" if self.scorer == "checkpoint"
                    else "scorer: hf needs the checkpoint folder (a local Hugging Face CLIP)")
        if self.scorer == "column":
            require(bool(self.column), join(prefix, "column"),
                    "scorer: column needs the name of the URL list's score column (e.g. similarity)")
        require(self.keep_fraction_of == "kept" or (self.scorer == "column" and self.keep_fraction is not None),
                join(prefix, "keep_fraction_of"), "pool takes keep_fraction over the list's own score column: it needs "
                "scorer: column and a keep_fraction (a model scores only the samples that were downloaded)")


def preflight(cfg: ClipScoreConfig) -> None:
    if cfg.enabled and cfg.scorer == "checkpoint":
        check_scorer(cfg.checkpoint, cfg.tokenizer)
    if cfg.enabled and cfg.scorer == "hf":
        from .hf_clip import check_hf

        check_hf(cfg.checkpoint)


SCALE = 1_000_000   # scores as integers of 1e-6


def select(keys: list[str], scores: np.ndarray, threshold: float | None, keep_fraction: float | None):
    """-> (boolean keep mask, the cut). The rule, on one table: ties go to the smaller key.
    The stage applies the same rule distributed (`cut_from_counts` + `keeps`)."""
    ints = np.round(np.asarray(scores, np.float64) * SCALE).astype(np.int64)
    if threshold is not None:
        return ints >= round(threshold * SCALE), float(threshold)
    c, m = cut_from_counts(Counter(ints.tolist()), len(keys), keep_fraction)
    tie_keys = sorted(k for k, v in zip(keys, ints) if v == c)
    last = tie_keys[m - 1] if m else None
    keep = np.array([keeps(v, k, c, last) for k, v in zip(keys, ints)], bool)
    return keep, (c / SCALE if c is not None else float("inf"))


def line_shift(counts: Counter, n: int, kept_cut: dict, keep_fraction: float) -> str | None:
    """What a dataset line's kept cut does to the samples added since it was drawn, when it keeps far
    fewer of them than the keep_fraction it was drawn at (their scores do not mean what the line's
    did); None when it keeps them at about the line's rate, or too few were added to tell."""
    cut, old = kept_cut.get("cut"), int(kept_cut.get("n") or 0)
    added = n - old
    if cut is None or added < 20:
        return None
    above = sum(c for v, c in counts.items() if v >= cut)
    rate = max(0, above - round(keep_fraction * old)) / added
    if rate >= keep_fraction / 3:
        return None
    return (f"the dataset line's cut keeps about {rate:.0%} of the {added} samples added since it was drawn, where it "
            f"kept {keep_fraction:.0%} of the line's first {old}: their scores have shifted (new data unlike the line's, "
            "or a scorer that scored pairs it trained on); check a few with `capline explain`, or end the line "
            "(stages.shard.append: false) and score it anew")


def cut_from_counts(counts: Counter, n: int, keep_fraction: float) -> tuple[int | None, int]:
    """From the count of each integer score: (the cut value c, how many samples tied at c to keep)."""
    n_keep = min(n, math.ceil(keep_fraction * n - 1e-9))
    if n_keep == 0:
        return None, 0
    above = 0
    for value in sorted(counts, reverse=True):
        if above + counts[value] >= n_keep:
            return value, n_keep - above
        above += counts[value]
    raise AssertionError("counts add up to fewer than n samples")


def keeps(score: int, key: str, cut: int | None, last_tied: str | None) -> bool:
    if cut is None:
        return False
    return score > cut or (score == cut and last_tied is not None and key <= last_tied)


SCORER_DIR = "clip_score/scorer"   # in the run folder's storage
SCORED = "clip_score/scored"       # each partition's scores, by scorer and content: kept across runs
LINE = "clip_score/line"           # the bootstrap scorer kept for later runs (bootstrap.reuse)
CUT = "clip_score/cut/line.json"   # keep_fraction's cut kept for later runs (reuse_cut)


# What the scorer is shown: the picture without a `border` resize's bars (dataplane.pictures). In
# each partition's reuse key, so scores made from padded squares by an earlier version are not reused.
SCORED_PICTURES = "unpadded"
# What a scores file holds: each sample's state with its score, so the verdicts are written from it
# alone (the input partition is read once, by the scoring task). Scores files of the format before
# (key and score only) are not reused.
SCORES_FILE = "with the samples"


def _scored_key(scorer: dict, device: str, u) -> str:
    text = json.dumps([scorer["kind"], scorer["sha256"], device, SCORED_PICTURES, SCORES_FILE, u.part, u.sha256])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
_SCORERS: dict = {}


def _scorer(storage, folder: str, sha: str, device: str, kind: str = "checkpoint"):
    """Once per worker process, from the run folder's storage (a copy fetched on another node)."""
    key = (storage.uri(folder), sha, device, kind)
    if key not in _SCORERS:
        _SCORERS.clear()
        if kind == "hf":
            from .hf_clip import HFScorer

            _SCORERS[key] = HFScorer(str(storage.local_dir(folder)), device)
        elif kind == "bootstrap" and storage.exists(f"{fold_dir(folder, 0)}/model.json"):
            _SCORERS[key] = CrossFitScorer([str(storage.local_dir(fold_dir(folder, k))) for k in range(FOLDS)], device)
        else:   # a checkpoint, or a dataset line's bootstrap scorer from before cross-fitting
            _SCORERS[key] = Scorer(str(storage.local_dir(folder)), None, device)
    return _SCORERS[key]


def _shared_scorer(ctx: StageContext, scorer: dict, cfg: ClipScoreConfig) -> SharedModel:
    """The scorer as the pool's actors load it: one copy an actor, its memory declared from the
    stored folder's size (weights, and as much again for a batch's activations and torch's copies)."""
    folder_mb = sum(n for _, n in ctx.storage.list_sized(SCORER_DIR, recursive=True)) / 2 ** 20
    return SharedModel(f"the {scorer['kind']} scorer {scorer['sha256'][:12]}", _scorer,
                       (ctx.storage, SCORER_DIR, scorer["sha256"], cfg.device, scorer["kind"]),
                       memory_mb=WORKER_MB + TORCH_MB + 3 * folder_mb, setting="stages.clip_score.cpus_per_worker")


def _score_task(storage, part: str, file: str, out: str, folder: str, sha: str, device: str,
                kind: str = "checkpoint") -> Scored:
    """Ray task: score one partition, write its scores (`out`.parquet, then the counts in
    `out`.json, which make them reusable), return how many of each value."""
    rows = by_location(read_kept(storage, file))
    scorer = _scorer(storage, folder, sha, device, kind) if rows.num_rows else None
    keyed = isinstance(scorer, CrossFitScorer)
    scores = np.concatenate([np.zeros(0), *(np.asarray(scorer.score(_decoded(batch, images), batch.column("caption").to_pylist(),
                                                                    *([batch.column("key").to_pylist()] if keyed else [])),
                                                       np.float64)
                                            for batch, images in picture_batches(storage, rows.select(["key", "caption", *PICTURE_COLUMNS])))])
    ints = np.round(np.asarray(scores, np.float64) * SCALE).astype(np.int64)
    return _write_scores(storage, out, part, rows, ints)


def _decoded(batch: pa.Table, images: list) -> list:
    """The batch's pictures, or a one-line error naming the first that ingest let through undecodable."""
    bad = [k for k, img in zip(batch.column("key").to_pylist(), images) if img is None]
    if bad:
        raise RuntimeError(f"clip_score: the image of {bad[0]} does not decode (ingest verified it: is the ingest "
                           "tar changed? `capline verify` checks it)")
    return images


def _write_scores(storage, out: str, part: str, rows: pa.Table, ints: np.ndarray) -> Scored:
    """The partition's kept rows as they came (their state) with their integer scores: what the
    verdict task reads instead of the input partition."""
    from ..dataplane import CARRIED

    state = [c for c in CARRIED if c in rows.column_names]
    table = pa.table({"key": rows.column("key"), "verdict": pa.array([KEPT] * rows.num_rows, pa.string()),
                      "score": pa.array(ints, pa.int64()), **{c: rows.column(c) for c in state}})
    storage.write_table(f"{out}.parquet", table)
    values, counts = np.unique(ints, return_counts=True)
    result = Scored(part, values.tolist(), counts.tolist())
    storage.write_json(f"{out}.json", result.to_json())
    return result


def _column_ints(rows: pa.Table, column: str) -> np.ndarray:
    """The URL list's own score column (in each sample's notes) as integer scores; missing: -1."""
    scores = []
    for n in rows.column("notes").to_pylist():
        got = json.loads(n) if n else {}
        v = got.get(column, got.get(f"source_{column}"))    # a list column named like capline's own is prefixed
        scores.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else -1.0)
    return np.round(np.clip(np.asarray(scores, np.float64), -1.0, 1.0) * SCALE).astype(np.int64)


def _column_task(storage, part: str, file: str, out: str, column: str) -> Scored:
    """Ray task: a partition's scores from the URL list's own column."""
    rows = read_kept(storage, file)
    return _write_scores(storage, out, part, rows, _column_ints(rows, column))


def _pool_counts_task(storage, file: str, column: str) -> dict[int, int]:
    """Ray task: how many rows of one source partition (the pool: every row the list names) have
    each score of the list's column."""
    values, counts = np.unique(_column_ints(read_kept(storage, file, ["notes"]), column), return_counts=True)
    return dict(zip(values.tolist(), counts.tolist()))


def _tied_task(storage, scores: str, cut: int) -> list[str]:
    t = storage.read_table(f"{scores}.parquet", ["key", "score"])
    return t.filter(pc.equal(t.column("score"), cut)).column("key").to_pylist()


def _decide(table: pa.Table, threshold: float | None, cut: int | None, last_tied: str | None,
            how: str) -> tuple[pa.Table, dict]:
    """A partition's verdicts from its scores file (`table`: the samples with their integer scores)."""
    out = {c: [] for c in ("key", "verdict", "reason", "score", "detail")}
    for k, v in zip(table.column("key").to_pylist(), table.column("score").to_pylist()):
        kept = v >= round(threshold * SCALE) if threshold is not None else keeps(v, k, cut, last_tied)
        for c, x in zip(out, (k, KEPT if kept else DROPPED, "" if kept else "clip_score", v / SCALE,
                              "" if kept else f"below {how}")):
            out[c].append(x)
    return pa.table(out, schema=pa.schema([("key", pa.string()), ("verdict", pa.string()), ("reason", pa.string()),
                                           ("score", pa.float64()), ("detail", pa.string())])), {}


@dataclass(frozen=True)
class Scored:
    """One partition's scores as counts: how many samples got each integer score (its record)."""
    part: str
    values: list
    counts: list

    def to_json(self) -> dict:
        return {"part": self.part, "values": self.values, "counts": self.counts}

    @classmethod
    def from_json(cls, d: dict) -> "Scored":
        return cls(d["part"], list(d["values"]), list(d["counts"]))


@dataclass
class Scores:
    """What the workers measured: the scorer and how many samples got each integer score."""
    scorer: dict
    counts: Counter
    files: dict = field(default_factory=dict)     # partition -> its scores (run-relative, no suffix)


@dataclass
class Cut:
    """The driver's decision: keep score >= threshold, or above `cut` (ties at it up to `last_tied`)."""
    how: str
    value: float
    cut: int | None = None
    last_tied: str | None = None
    shift: str | None = None     # a dataset line's cut that keeps far fewer new samples than it did (line_shift)


class ClipScoreStage(Decide):
    name = "clip_score"
    config_key, config_class = "clip_score", ClipScoreConfig
    reasons = ("clip_score",)
    report = "clip_score/report.html"
    notes = ("clip_score", "clip_score_detail")
    audits = (("mismatched_caption", "clip_score"),)
    score_cuts = ()

    def cut_lines(self, section: dict, stats: dict) -> list[tuple[str, float | None]]:
        """A fixed threshold, or the score the top `keep_fraction` was cut at (in its stats)."""
        if stats.get("threshold") is not None:
            return [("threshold", stats.get("threshold"))]
        return [(f"top {stats.get('keep_fraction')} cut", stats.get("cut"))]
    preserve = ("scored", "line", "cut", "examples", "reuse")

    def preflight(self, config) -> None:
        preflight(config.stages.clip_score)
        cfg = config.stages.clip_score
        if cfg.enabled and cfg.scorer == "column" and config.source.kind == "urls":
            from ..source.stage import require_columns

            # a misspelled column would score every sample -1 and keep nothing: said before the download
            require_columns(config.source, {"stages.clip_score.column": cfg.column})

    def run(self, ctx: StageContext) -> StageResult:
        if not ctx.cfg.enabled or not ctx.n_in:
            from ..dataplane import passthrough

            return StageResult(ctx.map_parts(passthrough), {"enabled": ctx.cfg.enabled})
        return super().run(ctx)

    def measure(self, ctx: StageContext) -> Scores:
        """Each partition scored by the workers (scores written beside the stage); their counts per value."""
        cfg: ClipScoreConfig = ctx.cfg
        if cfg.scorer == "column":
            import hashlib

            scorer = {"kind": "column", "column": cfg.column, "sha256": hashlib.sha256(cfg.column.encode()).hexdigest()}
            fn, args = _column_task, (cfg.column,)
            options = {"num_cpus": 0.5}
        else:
            scorer = self._scorer(ctx, cfg)
            fn, args = _score_task, (SCORER_DIR, scorer["sha256"], cfg.device, scorer["kind"])
            options = {"num_cpus": cfg.cpus_per_worker, "num_gpus": cfg.gpus_per_worker,
                       "setting": "stages.clip_score.gpus_per_worker", "model": _shared_scorer(ctx, scorer, cfg)}
        # a partition scored before by the same scorer is not scored again (a scheduled run scores
        # what it added, unless its scorer changed)
        found, outs = reused_or_run(
            ctx, fn, SCORED, lambda u: f"{u.part}-{_scored_key(scorer, cfg.device, u)}",
            lambda u, out: (ctx.storage, u.part, u.file, out, *args), "clip_score",
            f"scored before by scorer {scorer['sha256'][:12]}", "score", encode=Scored.to_json,
            decode=Scored.from_json, **options)
        counts: Counter = Counter()
        for f in found:
            counts.update(dict(zip(f.values, f.counts)))
        return Scores(scorer, counts, outs)

    def _pool_cut(self, ctx: StageContext, cfg: ClipScoreConfig) -> Cut:
        """keep_fraction over the pool, as DataComp cuts its baselines: the quantile of the list's
        score column over every row the source stage read, from the partitions' counts per value
        (a dataset line's pool grows with it, so its cut is recomputed each run). Samples tied at the
        cut value are all kept: with 1e-6 steps of a model's cosine, ties are rare."""
        files = [p["file"] for p in ctx.storage.read_json("source/parts.json") or []]
        counts: Counter = Counter()
        for got in ctx.run(_pool_counts_task, [(ctx.storage, f, cfg.column) for f in files], "clip_score pool",
                           num_cpus=0.25, quiet=True):
            counts.update({int(k): v for k, v in got.items()})
        n = sum(counts.values())
        cut, _ = cut_from_counts(counts, n, cfg.keep_fraction)
        value = cut / SCALE if cut is not None else float("inf")
        ctx.log(f"clip_score: top {cfg.keep_fraction:.0%} of the pool's {n} rows by {cfg.column}: cut {value:.6f} "
                "(stages.clip_score.keep_fraction_of: pool)")
        return Cut(f"top {cfg.keep_fraction:.0%} of the pool cut {value:.6f}", value, cut, "\uffff")

    def decide(self, ctx: StageContext, measured: Scores) -> Cut:
        """The cut: a threshold, or the exact quantile from the counts (tied keys fetched only if ties decide)."""
        cfg: ClipScoreConfig = ctx.cfg
        if cfg.threshold is not None:
            return Cut(f"threshold {cfg.threshold}", float(cfg.threshold))
        if cfg.keep_fraction_of == "pool":
            return self._pool_cut(ctx, cfg)
        kept_cut = ctx.storage.read_json(CUT) if cfg.reuse_cut else None
        if kept_cut and (kept_cut["scorer"], kept_cut["keep_fraction"]) == (measured.scorer["sha256"], cfg.keep_fraction):
            c = kept_cut["cut"]
            value = c / SCALE if c is not None else float("inf")
            ctx.log(f"clip_score: the dataset line's cut {value:.6f} (top {cfg.keep_fraction:.0%} of {kept_cut['n']} "
                    "samples when first computed), not recomputed (stages.clip_score.reuse_cut; set it false to "
                    "recompute the quantile over every sample)")
            how = kept_cut.get("how") or f"top {cfg.keep_fraction:.0%} cut {value:.6f}"
            shift = line_shift(measured.counts, ctx.n_in, kept_cut, cfg.keep_fraction)
            if shift:
                ctx.log(f"clip_score: warning: {shift}")
            return Cut(how, value, c, kept_cut["last_tied"], shift)   # verdicts read as the first run's
        if kept_cut:
            ctx.log(f"clip_score: the dataset line's cut was computed with scorer {kept_cut['scorer'][:12]} and "
                    f"keep_fraction {kept_cut['keep_fraction']}; recomputing it for this run's")
        cut, m = cut_from_counts(measured.counts, ctx.n_in, cfg.keep_fraction)
        last = None
        if cut is not None and m < measured.counts[cut]:
            keys = sorted(k for ks in ctx.run(_tied_task, [(ctx.storage, measured.files[u.part], cut)
                                                           for u in ctx.upstream or []],
                                              "clip_score ties", num_cpus=0.25, quiet=True) for k in ks)
            last = keys[m - 1]
        elif cut is not None:
            last = "\uffff"   # every sample at the cut value is kept
        value = cut / SCALE if cut is not None else float("inf")
        how = f"top {cfg.keep_fraction:.0%} cut {value:.6f}"
        if cfg.reuse_cut:       # this dataset line's cut from now on
            ctx.storage.write_json(CUT, {"scorer": measured.scorer["sha256"], "keep_fraction": cfg.keep_fraction,
                                         "cut": cut, "last_tied": last, "n": ctx.n_in, "how": how})
        return Cut(how, value, cut, last)

    def apply(self, ctx: StageContext, measured: Scores, decision: Cut) -> StageResult:
        cfg: ClipScoreConfig = ctx.cfg
        counts, scorer, n = measured.counts, measured.scorer, ctx.n_in
        # each partition judged from its scores file (its samples and their scores: the input is not
        # read again); one with the same scores under the same cut (a dataset line's) not judged again
        tasks = [PartTask(u.part, f"{measured.files[u.part]}.parquet", u.part,
                          kwargs={"threshold": cfg.threshold, "cut": decision.cut, "last_tied": decision.last_tied,
                                  "how": decision.how},
                          input_sha=u.sha256, depends=json.dumps([measured.files[u.part], cfg.threshold, decision.cut,
                                                                  decision.last_tied, decision.how]))
                 for u in ctx.upstream or []]
        cut_value = decision.value if decision.value != float("inf") else None
        parts = ctx.map_parts(_decide, tasks, num_cpus=0.5, reuse=True, pick=(cfg.examples_per_reason, cut_value))
        kept = sum(p.kept for p in parts)
        values = np.array(sorted(counts), np.float64) / SCALE
        weights = np.array([counts[v] for v in sorted(counts)], np.float64)
        hist, edges = np.histogram(values, bins=40, weights=weights)
        mean = float((values * weights).sum() / weights.sum())
        shown = write_examples(ctx, parts, cfg.examples_per_reason, "CLIP-score filter", cut=cut_value)
        ctx.log(f"clip_score: {scorer['kind']} scorer {scorer['sha256'][:12]}, kept {kept} "
                f"of {n} at {decision.how}; examples in {shown}")
        warning = small_bootstrap(scorer)
        if warning:
            ctx.log(f"clip_score: warning: {warning}")
        return StageResult(parts, {
            "enabled": True, "scorer": scorer, "warning": warning, "line_shift": decision.shift, "threshold": cfg.threshold, "keep_fraction": cfg.keep_fraction,
            "cut": cut_value, "score_mean": mean,
            "histogram": {"counts": hist.astype(int).tolist(), "edges": [round(float(e), 6) for e in edges]}},
            artifacts={"scorer": SCORER_DIR if scorer["kind"] != "column" else None, "scorer_sha256": scorer["sha256"],
                       "report": "clip_score/report.html"})

    def _scorer(self, ctx: StageContext, cfg: ClipScoreConfig) -> dict:
        """The scorer folder, in the run folder's storage (SCORER_DIR), where every worker reads it."""
        if cfg.scorer == "hf":
            from .hf_clip import check_hf

            info = check_hf(cfg.checkpoint)
            ctx.storage.put_dir(SCORER_DIR, cfg.checkpoint)
            return info
        if cfg.scorer == "checkpoint":
            info = check_scorer(cfg.checkpoint, cfg.tokenizer)
            ctx.storage.put_dir(SCORER_DIR, cfg.checkpoint)
            ctx.storage.write_bytes(f"{SCORER_DIR}/spm.model", Path(info["tokenizer"]).read_bytes())
            return info
        done = f"{SCORER_DIR}/scorer.json"
        if ctx.storage.exists(done):   # trained before this stage was interrupted: same input, same model
            ctx.log("clip_score: reusing the bootstrap scorer trained before the interruption")
            return ctx.storage.read_json(done)
        b = cfg.bootstrap
        if b.reuse and ctx.storage.exists(f"{LINE}/scorer.json"):
            _copy_folder(ctx.storage, LINE, SCORER_DIR)
            info = ctx.storage.read_json(done)
            ctx.log(f"clip_score: the bootstrap scorer of this dataset line ({info['sha256'][:12]}), not trained "
                    "again (stages.clip_score.bootstrap.reuse; set it false to retrain on the data as it is now)")
            return info
        trusted = frozenset(read_trusted_keys(b.trusted_keys)) if b.trusted_keys else None
        pool = len(trusted) if trusted is not None else ctx.n_in
        rows = first_in_seeded_order(ctx, b.max_samples, min(pool, ctx.n_in), ["caption", *PICTURE_COLUMNS],
                                     "clip_score sample", trusted)
        if trusted is not None and len(rows) < 2:
            raise UserError(f"stages.clip_score.bootstrap.trusted_keys: {len(rows)} of its keys reach this "
                            f"stage ({len(trusted)} listed); name keys of samples that survive the earlier stages")
        early = small_bootstrap({"kind": "bootstrap", "trained_on": len(rows)})
        if early:   # known before the first step, not after minutes of training
            ctx.log(f"clip_score: warning: {early}")
        ctx.log(f"clip_score: training the bootstrap scorer on {len(rows)} "
                f"{'trusted' if b.trusted_keys else 'input'} pairs ({b.steps} steps of {b.batch_size})")
        # in a task (a worker with the CPUs or a GPU), not in the driver; never more CPUs than a node has
        info = ctx.call(_train_task, ctx.storage, rows, what="clip_score bootstrap scorer", num_cpus=b.cpus,
                        cfg=b, seed=ctx.seed)
        info["trusted_keys"] = b.trusted_keys
        ctx.storage.write_json(done, info)
        if b.reuse:     # this dataset line's scorer from now on
            _copy_folder(ctx.storage, SCORER_DIR, LINE)
        return info


def _copy_folder(storage, src: str, dst: str) -> None:
    storage.delete(dst)
    for f in storage.list(src, recursive=True):
        storage.write_bytes(f"{dst}/{f[len(src) + 1:]}", storage.read_bytes(f))


def _train_task(storage, rows: list[dict], **kwargs) -> dict:
    """Train where the task runs, into a local temp folder, then put the folder in storage."""
    import tempfile

    import torch

    torch.set_num_threads(max(1, int(kwargs["cfg"].cpus)))
    table = pa.Table.from_pylist(rows)
    images = _decoded(table, pictures(table, read_images(storage, table)))
    cfg = kwargs.pop("cfg")
    # each fold's scorer trains on its fold's pairs for half the steps: the same compute as one
    # scorer on all of them, and no pair is scored by a model that saw it (scorer.py: FOLDS)
    half = dataclasses.replace(cfg, steps=max(1, math.ceil(cfg.steps / FOLDS)))
    folds = [[i for i, r in enumerate(rows) if fold_of(r["key"]) == k] for k in range(FOLDS)]
    if min(len(f) for f in folds) < 2:
        raise UserError(f"stages.clip_score: {len(rows)} pairs are too few to train the bootstrap scorer (each of its "
                        f"{FOLDS} halves needs 2 or more); set stages.clip_score.scorer to column, hf or checkpoint, or "
                        "stages.clip_score.enabled: false")
    infos = []
    with tempfile.TemporaryDirectory(prefix="capline-scorer-") as tmp:
        for k, idx in enumerate(folds):
            infos.append(train_bootstrap(images=[images[i] for i in idx], captions=[rows[i]["caption"] for i in idx],
                                         out_dir=fold_dir(tmp, k), cfg=half, what=f"(half {k + 1} of {FOLDS})",
                                         **kwargs))
        for k in range(FOLDS):
            storage.put_dir(fold_dir(SCORER_DIR, k), fold_dir(tmp, k))
    sha = hashlib.sha256("".join(i["sha256"] for i in infos).encode()).hexdigest()
    return {**infos[0], "path": SCORER_DIR, "sha256": sha, "trained_on": len(rows), "steps": half.steps,
            "folds": [{k: i[k] for k in ("trained_on", "final_loss", "chance_loss", "sha256")} for i in infos],
            "final_loss": float(np.mean([i["final_loss"] for i in infos]))}
