"""The dedup stage: decontaminate against evaluation sets, then remove duplicates within the data.

1. Each evaluation set in `eval_sets` gets a reference index (stages/eval_sets.py; built once and
   cached by content and parameters).
2. Ray Data reads the ingest shards; `map_batches` with an actor pool describes every image
   (stages/imagehash.py) and searches the evaluation indexes, each actor loading them once.
3. On the driver, deterministically (same result with any number of workers, on every rerun):
   - a match at cosine >= `eval_threshold` is dropped as `eval_duplicate:<set>` (detail
     `eval_duplicate:<set>:<id>`, the cosine as score);
   - identical pixels, or the same URL and caption, are `exact_duplicate`; images at cosine >=
     `within_threshold` are `near_duplicate`; of each cluster the smallest key is kept, the rest
     name it in their detail `duplicate_of=<key>`.

With `encoder_checkpoint` (a capline model directory), encoder embeddings are compared as well, by
cosine at `encoder_threshold`, through the same index class: either path can flag a match.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from trainers.configtools import join, require
from trainers.errors import UserError

from .actor_map import collect, ingest_dataset, map_actors
from .base import Ledger, Stage, StageContext, StageResult
from .eval_sets import EvalSetConfig, build_reference, check_exists
from .imagehash import describe, to_rgb_array
from .neardup import NearDupIndex


@dataclass
class DedupConfig:
    eval_sets: list[EvalSetConfig] = field(default_factory=list)
    eval_threshold: float = 0.92       # cosine of thumbnail descriptors
    within_threshold: float = 0.97
    colour_tol: float = 12.0           # max mean-colour difference per channel (0..255) for a match
    bits: int = 256                    # SimHash bits for the binary candidate search
    encoder_checkpoint: str | None = None
    encoder_threshold: float = 0.95
    num_workers: int = 2               # actors describing and searching
    cpus_per_worker: float = 0.75      # < 1 leaves room for Ray Data's read tasks on small machines
    batch_size: int = 256
    cache_dir: str = "~/.cache/capline/eval-index"

    def validate(self, prefix: str) -> None:
        for name in ("eval_threshold", "within_threshold", "encoder_threshold"):
            v = getattr(self, name)
            require(0 < v <= 1, join(prefix, name), f"a cosine threshold in (0, 1], got {v}")
        require(self.num_workers >= 1, join(prefix, "num_workers"), "must be >= 1")
        require(0 < self.cpus_per_worker <= 64, join(prefix, "cpus_per_worker"), "must be in (0, 64]")
        require(self.bits % 64 == 0 and self.bits > 0, join(prefix, "bits"), "must be a positive multiple of 64")
        names = [e.name for e in self.eval_sets]
        require(len(names) == len(set(names)), join(prefix, "eval_sets"), f"set names repeat: {names}")
        if self.encoder_checkpoint:
            require(Path(self.encoder_checkpoint).is_dir(), join(prefix, "encoder_checkpoint"),
                    f"{self.encoder_checkpoint} is not a capline model directory")


class EncoderDescriber:
    """Unit image embeddings from a capline checkpoint (GAP of the final tokens), no colour check."""

    def __init__(self, checkpoint: str):
        import torch

        from trainers.models.checkpoint import load_model

        self.torch = torch
        self.model, self.cfg = load_model(checkpoint)
        self.model.eval()

    def __call__(self, image) -> tuple[np.ndarray, np.ndarray]:
        from PIL import Image

        arr = to_rgb_array(image)
        s = self.cfg.image_size
        x = np.asarray(Image.fromarray(arr).resize((s, s), Image.BICUBIC)).astype(np.float32) / 127.5 - 1
        with self.torch.no_grad():
            f = self.model.image_features(self.torch.from_numpy(x).permute(2, 0, 1)[None])[0].numpy()
        return (f / (np.linalg.norm(f) + 1e-6)).astype(np.float32), np.zeros(3, np.float32)


class _Describe:
    """Ray Data actor: describe a batch of images and search every evaluation index (loaded once)."""

    def __init__(self, index_paths: dict[str, str], encoder_paths: dict[str, str], encoder_checkpoint: str | None):
        self.indexes = {name: NearDupIndex.load(Path(p)) for name, p in index_paths.items()}
        self.enc_indexes = {name: NearDupIndex.load(Path(p)) for name, p in encoder_paths.items()}
        self.encoder = EncoderDescriber(encoder_checkpoint) if encoder_checkpoint else None

    def __call__(self, batch: dict) -> dict:
        n = len(batch["__key__"])
        vecs, means, pix, ok = [], [], [], []
        for img in batch["jpg"]:
            try:
                arr = to_rgb_array(bytes(img))   # decode once: for the descriptor and the pixel hash
                d, m = describe(arr)
                pix.append(hashlib.sha256(arr.tobytes()).hexdigest())
                ok.append(True)
            except Exception:  # noqa: BLE001 - ingest verified decodability; count it if it happens
                d, m = np.zeros(768, np.float32), np.zeros(3, np.float32)
                pix.append("")
                ok.append(False)
            vecs.append(d)
            means.append(m)
        vecs, means = np.stack(vecs), np.stack(means)
        out = {"uid": [json.loads(j)["uid"] for j in batch["json"]], "vec": vecs.astype(np.float16),
               "mean": means, "pixel_sha": np.array(pix), "ok": np.array(ok)}
        best_set, best_id, best_sim = [""] * n, [""] * n, np.full(n, -1.0, np.float32)
        for kind, indexes, qv, qm in (("hash", self.indexes, vecs, means), ("encoder", self.enc_indexes, None, None)):
            if not indexes:
                continue
            if kind == "encoder":
                qv, qm = map(np.stack, zip(*(self.encoder(bytes(img)) for img in batch["jpg"])))
            for name, index in indexes.items():
                idx, sim = index.search(qv, qm)
                for q in range(n):
                    if idx[q] >= 0 and sim[q] > best_sim[q] and ok[q]:
                        best_set[q], best_id[q], best_sim[q] = f"{name}|{kind}", index.ids[idx[q]], sim[q]
        out.update({"eval_set": np.array(best_set), "eval_id": np.array(best_id), "eval_sim": best_sim})
        return out


def _clusters(pairs: list[tuple[int, int]], n: int) -> np.ndarray:
    """Union-find over index pairs; returns each item's root (the smallest index in its cluster)."""
    parent = np.arange(n)

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return np.array([find(i) for i in range(n)])


class DedupStage(Stage):
    name = "dedup"

    def section(self, config) -> DedupConfig:
        return config.stages.dedup

    def fingerprint(self, config) -> str:
        # the evaluation sets' content decides the result as much as their config
        from .eval_sets import stat_fingerprint

        cfg = self.section(config)
        return super().fingerprint(config) + "".join(
            sorted(f"{e.name}:{stat_fingerprint(e)}" for e in cfg.eval_sets))

    def run(self, ctx: StageContext) -> StageResult:

        cfg: DedupConfig = ctx.config.stages.dedup
        for es in cfg.eval_sets:
            check_exists(es, ctx.run_dir)
        cache = Path(cfg.cache_dir).expanduser()
        params = {"descriptor": "thumb16-v2", "bits": cfg.bits, "colour_tol": cfg.colour_tol}
        index_paths, enc_paths, set_stats = {}, {}, {}
        for es in cfg.eval_sets:
            path, st = build_reference(es, ctx.run_dir, cache, params, log=ctx.log)
            index_paths[es.name], set_stats[es.name] = str(path), st
            if cfg.encoder_checkpoint:
                enc_params = {"descriptor": "encoder", "checkpoint": _dir_digest(cfg.encoder_checkpoint),
                              "bits": cfg.bits, "colour_tol": None}
                epath, _ = build_reference(es, ctx.run_dir, cache, enc_params,
                                           describer=EncoderDescriber(cfg.encoder_checkpoint), log=ctx.log)
                enc_paths[es.name] = str(epath)

        ds = map_actors(ingest_dataset(ctx.upstream["ingest"]), _Describe,
                        (index_paths, enc_paths, cfg.encoder_checkpoint), cfg.num_workers, cfg.batch_size,
                        cfg.cpus_per_worker)
        data = collect(ds, ["uid", "vec", "mean", "pixel_sha", "ok", "eval_set", "eval_id", "eval_sim"], key="uid")
        ctx.log(f"dedup: described {len(data['uid'])} images with {cfg.num_workers} workers")
        return self._decide(ctx, cfg, data, set_stats)

    def _decide(self, ctx, cfg: DedupConfig, data: dict, set_stats: dict) -> StageResult:
        ledger = Ledger(self.name)
        order = np.argsort(data["uid"], kind="stable")           # by key: worker count cannot matter
        data = {k: v[order] for k, v in data.items()}
        keys = [str(k) for k in data["uid"]]
        upstream = set(ctx.upstream_kept or [])
        missing = upstream - set(keys)
        if missing:
            raise RuntimeError(f"dedup: {len(missing)} kept ingest samples not found in the shards (e.g. {sorted(missing)[:3]})")
        src = pq.read_table(ctx.upstream["source"] / "urls.parquet", columns=["key", "url", "caption"]).to_pydict()
        url_caption = dict(zip(src["key"], zip(src["url"], src["caption"])))
        n = len(keys)
        decided = np.zeros(n, bool)
        eval_counts: dict[str, int] = {}
        for i in range(n):
            if not data["ok"][i]:
                ledger.drop(keys[i], "undecodable_image", detail="could not be described")
                decided[i] = True
                continue
            set_kind = str(data["eval_set"][i])
            if set_kind:
                name, kind = set_kind.split("|")
                thr = cfg.eval_threshold if kind == "hash" else cfg.encoder_threshold
                sim = float(data["eval_sim"][i])
                if sim >= thr:
                    ledger.drop(keys[i], f"eval_duplicate:{name}", score=sim,
                                detail=f"eval_duplicate:{name}:{data['eval_id'][i]} ({kind})")
                    eval_counts[name] = eval_counts.get(name, 0) + 1
                    decided[i] = True
        # within the data: exact pairs by pixels and by (url, caption), near pairs by the index
        pairs: list[tuple[int, int]] = []
        kinds: dict[tuple[int, int], str] = {}
        first_by: dict = {}
        for i in np.where(~decided)[0]:
            for sig in (("px", data["pixel_sha"][i]), ("uc", url_caption.get(keys[i]))):
                j = first_by.setdefault(sig, i)
                if j != i:
                    pairs.append((j, i))
                    kinds[(j, i)] = "exact_duplicate"
        live = np.where(~decided)[0]
        vecs = data["vec"][live].astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True) + 1e-6
        within = NearDupIndex(bits=cfg.bits, colour_tol=cfg.colour_tol).build([keys[i] for i in live], vecs, data["mean"][live])
        nn_i, nn_s = within.search(vecs, data["mean"][live], exclude_self=True)
        sims = {}
        for q, (j, s) in enumerate(zip(nn_i, nn_s)):
            if j >= 0 and s >= cfg.within_threshold:
                a, b = sorted((int(live[q]), int(live[j])))
                pairs.append((a, b))
                kinds.setdefault((a, b), "near_duplicate")
                sims[b] = max(sims.get(b, -1), float(s))
        root = _clusters(pairs, n)
        reason_of = {}
        for (a, b), kind in kinds.items():
            reason_of[b] = "exact_duplicate" if kind == "exact_duplicate" or reason_of.get(b) == "exact_duplicate" else kind
        clusters = 0
        for i in np.where(~decided)[0]:
            r = int(root[i])
            if r == i:
                ledger.keep(keys[i])
                continue
            clusters += 1
            ledger.drop(keys[i], reason_of.get(i, "near_duplicate"), score=sims.get(i),
                        detail=f"duplicate_of={keys[r]}")
        ctx.log(f"dedup: {sum(eval_counts.values())} evaluation-set matches, "
                f"{clusters} within-data duplicates")
        return StageResult(ledger, {"eval_sets": set_stats, "eval_matches": eval_counts,
                                    "method": {"descriptor": "thumb16-v2", "eval_threshold": cfg.eval_threshold,
                                               "within_threshold": cfg.within_threshold,
                                               "encoder_checkpoint": cfg.encoder_checkpoint}})


def _dir_digest(path: str) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def preflight(cfg: DedupConfig, run_dir: Path | None) -> None:
    for es in cfg.eval_sets:
        if es.kind == "builtin" and es.path == "demo_heldout":
            continue  # made by the source stage of this very run
        check_exists(es, run_dir)
    if cfg.encoder_checkpoint and not (Path(cfg.encoder_checkpoint) / "model.json").is_file():
        raise UserError(f"stages.dedup.encoder_checkpoint {cfg.encoder_checkpoint}: not a capline model checkpoint")
