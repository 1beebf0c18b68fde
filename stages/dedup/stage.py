"""The dedup stage top to bottom: it plans the steps and reads their counts (the steps are this package's modules)."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from infra.errors import UserError
from infra.shuffle import map_groups

from ..base import Decide, StageContext, StageResult
from ..dataplane import PartTask, reused_or_run
from .layout import EDGE_DIR, LINE_EDGES, LINE_EDGES_RECORD, PAIR_DIR, WANTED_DIR, Clusters, Described, Signed
from .report import PAIRS_PER_REASON
from .eval_sets import alike_share, build_reference, check_exists
from .lsh import band_plan
from .neardup import NearDupIndex
from .components import _components_task
from .config import DedupConfig, _dir_digest, hamming_radius, preflight
from .describe import DESCRIBED, WITHIN_DESCRIPTOR, _describe_task, _described_key, eval_search, shared_describer
from .encoder import EncoderDescriber
from .group import MAP_SIGNATURES, PAIR_FAN_IN, _group_reduce, _sig_pieces
from .sign import SIGNED, _sign_task, _signed_key, bucket_count, sigs_per_sample
from .verdicts import _eval_captions, _verdicts
from .verify import FETCH_PARTS, _fetch_pieces, _verify_reduce, fetch_spans


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
    signed: dict = field(default_factory=dict)  # partition -> its signatures' prefix (what its edges come from)
    carried: tuple | None = None  # an append: (the dataset line's edges file, the partitions not searched again)
    chunks: dict = field(default_factory=dict)  # the line's signatures in chunks: file -> {parts, rows}
    told_apart: int = 0           # near candidates the thumbnail joined and the detail descriptor told apart


ALIKE_WARN = 0.05   # a set whose images are this alike under the thumbnail descriptor is warned of


def _alike(name: str, stats: dict, threshold: float, matched: int, encoder: bool = False) -> dict:
    """A set's stats for the stage's summary, with the share of its images that have another of its
    images at `eval_threshold` (`alike`), and, where that is over ALIKE_WARN and the set matched
    samples of this run, a warning: images of a low-variety set's kind that are not in it are dropped
    as its duplicates too. At 0.92: scikit-learn's digits 0.65, Fashion-MNIST's test split 0.56 (its
    training split, 50,000 images, drops 60 % of the test split: benchmarks/eval_recall.py), the
    demo's held-out split 0. `encoder`: an encoder is compared already (a thumbnail match still drops)."""
    out = {k: v for k, v in stats.items() if k != "nearest_other"}
    out["alike"] = share = alike_share(stats, threshold)
    out["alike_warn"] = ALIKE_WARN        # the dataset card says it as the run had it
    if share is not None and share > ALIKE_WARN and matched:
        out["warning"] = (f"evaluation set {name}: {share:.0%} of its images have another of its images within "
                          f"stages.dedup.eval_threshold ({threshold:g}) of the thumbnail descriptor, which cannot "
                          f"tell this set's images apart: of the {matched} samples dropped as its duplicates, "
                          "images of its kind that are not in it may be many; "
                          + ("raise stages.dedup.eval_threshold so that stages.dedup.encoder_checkpoint decides"
                             if encoder else "give stages.dedup.encoder_checkpoint an image-copy descriptor "
                             "(DataComp's ISC) and raise stages.dedup.eval_threshold")
                          + ", or leave the set out")
    return out


class DedupStage(Decide):
    name = "dedup"
    config_key, config_class = "dedup", DedupConfig
    reasons = ("exact_duplicate", "near_duplicate", "eval_duplicate", "undecodable_image", "removed", "eval_caption")
    report = "dedup/report.html"
    score_cuts = ("eval_threshold", "within_threshold")
    # partitions described, and examples picked, before: by what decided them (a scheduled run's reuse)
    preserve = ("described", "signed", "examples", "reuse", "edges")
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
        arrays = {"hash": {n: NearDupIndex.load(p).arrays() for n, p in index_paths.items()},
                  "encoder": {n: NearDupIndex.load(p).arrays() for n, p in enc_paths.items()}}
        blobs = ctx.put(arrays)
        search = eval_search(arrays)
        names = tuple(sorted(p.name for p in [*index_paths.values(), *enc_paths.values()]))
        args = (blobs, names, encoder_rel)
        model = shared_describer(encoder_rel, cfg, arrays)
        # a partition described by an earlier run with the same input and config is reused (a
        # scheduled run that added 1 % describes the 1 %), whatever the run's size
        # (a partition described now is signed in the same task for this run's band plan)
        signed_as = lambda u, out: f"{SIGNED}/{_signed_key(u.part, out, plan)}"   # noqa: E731
        described, outs = reused_or_run(
            ctx, _describe_task, DESCRIBED, lambda u: _described_key(ctx.fingerprint, u, search),
            lambda u, out: (ctx.storage, u.part, u.file, *args, cfg, out, (plan, n_buckets, signed_as(u, out))),
            "dedup describe", "described before with the same input", "describe", num_cpus=cfg.cpus_per_worker,
            model=model, encode=Described.to_json, decode=Described.from_json)
        ctx.log(f"dedup: described {sum(d.described for d in described)} images")
        # signatures for this size's band plan: a partition signed before under the same plan, or
        # just now by its describe task, is reused; its file serves any bucket count (range buckets)
        just_signed = {u.part: d.signed for u, d in zip(upstream, described)
                       if d.signed is not None and d.signed.as_ == signed_as(u, outs[u.part])}
        _, signed = reused_or_run(
            ctx, _sign_task, SIGNED, lambda u: _signed_key(u.part, outs[u.part], plan),
            lambda u, out: (ctx.storage, u.part, f"{outs[u.part]}.desc.parquet", cfg, plan, n_buckets, out),
            "dedup sign", f"signed before for {plan.bands} bands of {plan.width} bits", "sign",
            given=just_signed, encode=Signed.to_json, decode=Signed.from_json, num_cpus=cfg.cpus_per_worker)
        # an append to a dataset line searches only the groups its new partitions touch: the line's
        # edges between the partitions it had (same signatures, so the same pairs) are carried
        fresh, carried, chunks = _fresh_since_line(ctx.storage, {u.part: signed[u.part] for u in upstream})
        if fresh is not None:
            ctx.log(f"dedup: {len(upstream) - len(fresh)} partitions' pairs carried from the dataset line's edges; "
                    f"searching the groups of {len(fresh)} new ones")
        # pairs are few next to signatures: fewer pair buckets, so the fetch and verify tasks each
        # open the group tasks' files n_buckets / PAIR_FAN_IN times fewer
        n_pairs = max(1, math.ceil(n_buckets / PAIR_FAN_IN))
        # the near candidates' descriptors are fetched by partition: a task per FETCH_PARTS
        # partitions at least (one task reading 2,000 partitions' files took 11 s of an append)
        n_fetch = max(n_pairs, min(int(ctx.cluster_cpus()), math.ceil(len(upstream) / FETCH_PARTS)))
        # each partition's signatures read once and handed to the group tasks through Ray's object
        # store: a group task opens no file (it opened every signature file, or merged copies of them);
        # a map task reads several partitions' files, up to MAP_SIGNATURES rows, and keeps them as one
        # chunk of the line's signatures; an append's maps read those chunks and the new partitions'
        # files (2,000 files of a few rows cost its map tasks 7 s of parsing)
        maps, chunks = _sig_maps(ctx, upstream, signed, plan, fresh, chunks)
        found = ctx.shuffle(_sig_pieces, [(ctx.storage, units, n_buckets, keep_as) for units, keep_as in maps],
                            n_buckets, _group_reduce, [(ctx.storage, b, cfg, n_pairs, n_fetch, fresh)
                                                       for b in range(n_buckets)],
                            "dedup group", num_cpus=cfg.cpus_per_worker) if maps else []
        # only the files written (no empty ones): a reducer opens just those
        pair_files = [f"{PAIR_DIR}/{b:06d}.parquet" for b, f in enumerate(found) if f.pairs]
        wanted_files = [f"{WANTED_DIR}/{b:06d}.parquet" for b, f in enumerate(found) if f.wanted]
        desc = {p: f"{o}.desc.parquet" for p, o in outs.items()}
        # the candidates' descriptors, fetched by partition, reach the verify task of their pair
        # bucket through Ray's object store (no file between them)
        spans = fetch_spans(n_fetch, sum(f.wanted for f in found))
        with_detail = cfg.within_detail_threshold > 0
        checked = ctx.shuffle(_fetch_pieces, [(ctx.storage, span, wanted_files, desc, n_pairs, with_detail)
                                              for span in spans]
                              if wanted_files else [], n_pairs, _verify_reduce,
                              [(ctx.storage, b, pair_files, cfg.within_threshold, cfg.within_detail_threshold)
                               for b in range(n_pairs)],
                              "dedup verify", num_cpus=cfg.cpus_per_worker) if pair_files else []
        edge_files = [f"{EDGE_DIR}/{b:06d}.parquet" for b, c in enumerate(checked) if c.edges]
        return Candidates(sum(c.exact for c in checked), sum(c.near for c in checked),
                          sum(c.candidates for c in checked), edge_files,
                          set_stats, max((f.largest_group for f in found), default=0), n_buckets,
                          plan.describe(cfg.within_threshold), desc,
                          {"group": len(found), "fetch": len(spans) if wanted_files and pair_files else 0, "verify": len(checked)},
                          {u.part: signed[u.part] for u in upstream}, carried, chunks,
                          sum(c.told_apart for c in checked))

    def decide(self, ctx: StageContext, found: Candidates) -> Clusters:
        """Pairs joined into clusters, in a task; of each the smallest key is kept. -> counts per
        partition and a few drops to show (the decisions themselves stay in the run folder)."""
        from ..shard.line import published_parts, read_line

        parts = sorted(u.part for u in ctx.upstream or [])
        line = read_line(ctx.storage)      # an append-only dataset line: what it published stays kept
        shards = frozenset(s["name"] for s in line["shards"]) if line else frozenset()
        pub = frozenset(published_parts(ctx.storage) & set(parts)) if line else frozenset()
        keep_as = f"{LINE_EDGES}/{_digest(found.signed)}.parquet"
        out = ctx.call(_components_task, ctx.storage, found.edge_files, parts, PAIRS_PER_REASON, shards, pub,
                       found.carried, keep_as, what="dedup components", num_cpus=ctx.cfg.cpus_per_worker)
        # the line's edges now: named last (the file above is whole), the one they replace deleted
        ctx.storage.write_json(LINE_EDGES_RECORD, {"file": keep_as, "signed": found.signed, "chunks": found.chunks})
        # the edges and chunks no longer named (one listing: a run that stopped early wrote some too)
        ctx.storage.delete_files([f for f in ctx.storage.list(LINE_EDGES, recursive=True)
                                  if f not in (keep_as, LINE_EDGES_RECORD) and f not in found.chunks])
        ctx.log(f"dedup: {found.exact} exact pairs, {found.n_candidates} near candidates, {found.near} "
                f"near pairs" + (f" ({found.told_apart} more told apart by their detail)" if found.told_apart else "")
                + (f" (searched for the new partitions; {out.edges_carried} pairs carried)"
                   if found.carried else "") + f", {out.duplicates} within-data duplicates"
                + (f"; {out.published_kept} published sample(s) of this dataset line kept beside the one "
                   "their cluster keeps" if out.published_kept else ""))
        return out

    def apply(self, ctx: StageContext, found: Candidates, decisions: Clusters) -> StageResult:
        from ..shard.removals import DESCRIPTIONS, removal_digest

        cfg: DedupConfig = ctx.cfg
        index = {p: i for i, p in enumerate(sorted(u.part for u in ctx.upstream or []))}
        # where each partition's descriptions are: `capline remove` matches images against them
        ctx.storage.write_json(DESCRIPTIONS, dict(sorted(found.desc.items())))
        # a dataset line's removals: what they name never comes back (pipeline/remove.py)
        removals = removal_digest(ctx.storage)
        captions = _eval_captions(ctx.storage, cfg, ctx.run_dir)
        tasks = [PartTask(u.part, u.file, u.part,
                          kwargs={"part": u.part, "index": index[u.part], "has_decisions": u.part in decisions.per_part,
                                  "cfg": cfg, "storage": ctx.storage, "desc": found.desc[u.part],
                                  "removals": removals, "captions": captions},
                          input_sha=u.sha256, depends=f"{found.desc[u.part]}:{decisions.digests.get(u.part, '')}"
                                                      + (f":{removals}" if removals else "")
                                                      + (f":{captions[1]}" if captions else ""))
                 for u in ctx.upstream or []]
        parts = ctx.map_parts(_verdicts, tasks, num_cpus=0.5, reuse=True, pick=(PAIRS_PER_REASON, None))
        from .report import write_report

        ctx.log(f"dedup: pairs side by side in {write_report(ctx, decisions.shown, parts)}")
        evals: dict[str, int] = {}
        caption_hits: dict[str, int] = {}
        for p in parts:
            for name, c in p.extra.get("eval_matches", {}).items():
                evals[name] = evals.get(name, 0) + c
            for name, c in p.extra.get("caption_matches", {}).items():
                caption_hits[name] = caption_hits.get(name, 0) + c
        sets = {name: _alike(name, st, cfg.eval_threshold, evals.get(name, 0), bool(cfg.encoder_checkpoint))
                for name, st in found.set_stats.items()}
        for st in sets.values():
            if "warning" in st:
                ctx.log(f"dedup: warning: {st['warning']}")
        return StageResult(parts, {"eval_sets": sets, "eval_matches": evals,
                                   "caption_matches": {"mode": cfg.caption_match, "captions": captions[2] if captions else 0,
                                                       "by_set": caption_hits},
                                   "largest_lsh_group": found.largest_group,
                                   "reduce_tasks": found.reduce_tasks,
                                   "published_kept": decisions.published_kept,
                                   "edges": {"total": decisions.edges, "carried": decisions.edges_carried,
                                             "searched": "new partitions" if found.carried else "all"},
                                   "pairs": {"exact": found.exact, "near_candidates": found.n_candidates,
                                             "near": found.near, "told_apart_by_detail": found.told_apart},
                                   "method": {"descriptor": WITHIN_DESCRIPTOR, "eval_threshold": cfg.eval_threshold,
                                              "within_threshold": cfg.within_threshold,
                                              "within_detail_threshold": cfg.within_detail_threshold,
                                              "lsh": f"{found.lsh}, Hamming radius "
                                                     f"{hamming_radius(cfg.within_threshold, cfg.bits)}",
                                              "encoder_checkpoint": cfg.encoder_checkpoint}},
                           artifacts={"report": "dedup/report.html"})


def _digest(signed: dict) -> str:
    return hashlib.sha256(json.dumps(signed, sort_keys=True).encode()).hexdigest()[:16]


def _fresh_since_line(storage, signed: dict[str, str]) -> tuple[frozenset | None, tuple | None, dict]:
    """Which partitions an append must search pairs for: those the dataset line's edges were not
    found from. Incremental only when every partition the edges came from is still here with the
    same signatures (an exact group pairs its members with its smallest key, so a partition gone
    or changed could leave two others joined through it: then everything is searched again).
    -> (the new partitions, (the edges file, the others)), or (None, None): search everything; and
    the line's signature chunks (when they still hold its partitions)."""
    line = storage.read_json(LINE_EDGES_RECORD, default=None) or {}
    file, before = line.get("file"), line.get("signed")
    if not before or not storage.exists(file) or any(signed.get(p) != s for p, s in before.items()):
        return None, None, {}
    return frozenset(p for p in signed if p not in before), (file, frozenset(before)), line.get("chunks") or {}


MAX_CHUNKS = 256     # the line's signature chunks an append reads as they are; past it they are made anew


def _sig_maps(ctx, upstream, signed: dict, plan, fresh: frozenset | None, chunks: dict) -> tuple[list, dict]:
    """The group shuffle's map calls, (units, chunk to keep them as), and the line's chunks after it.
    Everything searched: the partitions' files in groups of up to MAP_SIGNATURES rows, each group
    kept as a chunk. An append: the line's chunks as they are, several to a map task up to
    MAP_SIGNATURES rows (nothing written; a task per chunk started 17 tasks, most in new worker
    processes, for an append's 20 partitions), and the new partitions' files grouped and kept as new
    chunks; nothing new: no map at all."""
    rows = {u.part: u.kept * sigs_per_sample(plan) for u in upstream}
    files = {u.part: f"{signed[u.part]}.sig.parquet" for u in upstream}
    if fresh is not None and not fresh:
        return [], chunks
    old = chunks if fresh is not None and len(chunks) < MAX_CHUNKS else {}
    held = {p for c in old.values() for p in c["parts"]}
    todo = [u.part for u in upstream if u.part not in held]
    names = list(old)
    maps = [([(names[i], [files[p] for p in old[names[i]]["parts"]]) for i in g], None)
            for g in map_groups([old[n]["rows"] for n in names], MAP_SIGNATURES, 1)]
    after = dict(old)
    for g in map_groups([rows[p] for p in todo], MAP_SIGNATURES, int(ctx.cluster_cpus()) if not old else 1):
        parts = [todo[i] for i in g]
        name = f"{LINE_EDGES}/sigs/{_digest({p: signed[p] for p in parts})}.parquet"
        maps.append(([(files[p], []) for p in parts], name))
        after[name] = {"parts": parts, "rows": sum(rows[p] for p in parts)}
    return maps, after
