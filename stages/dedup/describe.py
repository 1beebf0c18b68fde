"""Step 2: describe each partition's images once and search the evaluation indexes (partitions on an
actor pool: each actor holds the indexes and the encoder once, stages/shared_model.py)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..dataplane import PICTURE_COLUMNS, by_location, picture_batches
from ..shared_model import TORCH_MB, WORKER_MB, SharedModel
from .imagehash import DETAIL_DIM, describe, detail, framed_descriptors, to_rgb_array, trim_border
from .neardup import NearDupIndex, search_plan
from .config import DedupConfig
from .encoder import EncoderDescriber
from .layout import Described


_LOADED: dict = {}


def _indexes(storage, blobs: dict, names: tuple, encoder_checkpoint: str | None, image_size: int = 224,
             encoder_sha256: str | None = None):
    """Made once per actor of the describe pool, however many partitions it describes. The driver loaded the
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


def shared_describer(encoder_rel: str | None, cfg: DedupConfig, arrays: dict) -> SharedModel:
    """What each describe actor holds (`_indexes`): the evaluation sets' Hamming indexes (its own
    copy, ~3x the codes' bytes with faiss's structures; the vectors stay in the node's object
    store, shared) and, with `encoder_checkpoint`, the encoder (torch, and 3x its weights)."""
    codes = sum(a["codes"].nbytes for sets in arrays.values() for a in sets.values() if "codes" in a)
    memory = WORKER_MB + 3 * codes / 2 ** 20
    if encoder_rel:
        src = Path(cfg.encoder_checkpoint)
        weights = src.stat().st_size if src.is_file() else sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        memory += TORCH_MB + 3 * weights / 2 ** 20
    what = "the evaluation indexes" + (" and the encoder" if encoder_rel else "")
    # loaded by the first call an actor runs (`_indexes`): the arrays come as each call's argument
    return SharedModel(what, None, memory_mb=memory, setting="stages.dedup.cpus_per_worker")


def _describe_task(storage, part: str, file: str, blobs: dict, names: tuple,
                   encoder_checkpoint: str | None, cfg: DedupConfig, out: str, sign: tuple | None = None) -> Described:
    """Ray task: describe one partition's images (each decoded once), search the evaluation sets,
    write each sample's descriptor, SimHash code, mean colour and exact hashes to `<out>.desc.parquet`,
    then the record that makes them reusable by a later run with the same partition. -> small counts.
    Nothing here depends on how many samples the run has: the band signatures, which do, are the
    sign step's (`_sign_task`), from this file, without decoding an image again; `sign` (the band
    plan, the bucket count, the signatures' prefix): this run's are made here too, and the result
    says so (`signed`), sparing the partition a sign task."""
    from ..dataplane import read_kept
    from .imagehash import simhash

    rows = by_location(read_kept(storage, file, ["key", "url", "caption", *PICTURE_COLUMNS]))
    indexes, enc_indexes, encoder = _indexes(storage, blobs, names, encoder_checkpoint, cfg.encoder_image_size,
                                             cfg.encoder_sha256)
    hash_sets = bool(indexes)
    n = rows.num_rows
    vec16, means, codes = np.zeros((n, 768), np.float16), np.zeros((n, 3), np.float32), np.zeros((n, cfg.bits // 8), np.uint8)
    detail16 = np.zeros((n, DETAIL_DIM), np.float16)
    framed_vec: list[bytes | None] = [None] * n     # the picture inside a flat frame, for removals
    framed_detail: list[bytes | None] = [None] * n
    pix, ok = [bytes(16)] * n, np.zeros(n, bool)
    best_set, best_id, best_sim = [""] * n, [""] * n, np.full(n, -1.0, np.float32)
    at = 0
    # memory: a batch's images, whatever n is; each decoded once and seen without a resize's bars
    for batch, images in picture_batches(storage, rows):
        m = batch.num_rows
        vecs = np.zeros((m, 768), np.float32)
        framed: list[tuple[int, np.ndarray, np.ndarray]] = []    # (row in batch, descriptor, mean) inside flat bars
        for j, img in enumerate(images):
            i = at + j
            if img is None:
                continue     # ingest verified decodability; counted as undecodable if it happens
            arr = to_rgb_array(img)   # for the descriptors and the pixel hash
            core = trim_border(arr)   # once for both: a trimmed picture's edges end either one's trim at once
            vecs[j], means[i] = describe(core)
            detail16[i] = detail(core)
            pix[i] = hashlib.sha256(arr.tobytes()).digest()[:16]
            ok[i] = True
            if (inside := framed_descriptors(arr)) is not None:
                fv, fm, fd = inside
                framed_vec[i], framed_detail[i] = fv.astype(np.float16).tobytes(), fd.astype(np.float16).tobytes()
                if hash_sets:
                    framed.append((j, fv, fm))
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
            sets, ids, sims = best_matches(idx_map, kind, qv, qm, framed if kind == "hash" else [])
            for j in np.flatnonzero(sims > best_sim[at:at + m]):
                if ok[at + j]:
                    best_set[at + j], best_id[at + j], best_sim[at + j] = sets[j], ids[j], sims[j]
        at += m
    keys = rows.column("key").to_pylist()
    url_caption = [hashlib.blake2b(f"{u}\0{c}".encode(), digest_size=16).digest() for u, c in
                   zip(rows.column("url").to_pylist(), rows.column("caption").to_pylist())]
    table = pa.table({
        "key": keys, "vec": pa.array([v.tobytes() for v in vec16], pa.binary()),
        "detail": pa.array([v.tobytes() for v in detail16], pa.binary()),
        "framed_vec": pa.array(framed_vec, pa.binary()), "framed_detail": pa.array(framed_detail, pa.binary()),
        "ok": ok, "eval_set": best_set, "eval_id": best_id, "eval_sim": best_sim,
        "code": pa.array([c.tobytes() for c in codes], pa.binary()),
        "mean": pa.FixedSizeListArray.from_arrays(pa.array(means.ravel()), 3),
        "pixels": pa.array(pix, pa.binary()), "url_caption": pa.array(url_caption, pa.binary())})
    storage.write_table(f"{out}.desc.parquet", table)
    result = Described(part, n, int((~ok).sum()))
    storage.write_json(f"{out}.json", result.to_json())     # last: the file above is whole
    if sign is None:
        return result
    from .sign import SIGN_COLUMNS, sign_rows

    # not in the record: what this task signed is said to this run only (a later run's plan, or a
    # signature file deleted since, is the sign step's to judge)
    plan, n_buckets, signed_out = sign
    return dataclasses.replace(result, signed=sign_rows(storage, part, table.select(SIGN_COLUMNS), cfg, plan,
                                                        n_buckets, signed_out))


def framed_query(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The evaluation query of a picture inside bars of one flat colour other than black, without
    them (`imagehash.framed_descriptors`); None where it has none."""
    inside = framed_descriptors(arr)
    return None if inside is None else inside[:2]


def best_matches(idx_map: dict, kind: str, vecs: np.ndarray, means: np.ndarray,
                 framed: list[tuple[int, np.ndarray, np.ndarray]]) -> tuple[list[str], list[str], np.ndarray]:
    """Each query row's best match over the evaluation sets of one descriptor kind (`idx_map`: set
    name -> NearDupIndex), its rows in `framed` (row, descriptor, mean: `framed_query`) searched a
    second time inside their frame. -> ("set|kind" or "", the reference's id or "", cosine or -1)."""
    m = len(vecs)
    sets, ids, sims = [""] * m, [""] * m, np.full(m, -1.0, np.float32)
    queries = [(range(m), vecs, means)]
    if framed:
        queries.append(([j for j, _, _ in framed], np.stack([v for _, v, _ in framed]), np.stack([c for _, _, c in framed])))
    for name, index in idx_map.items():
        for rows, q_vecs, q_means in queries:
            idx, sim = index.search(q_vecs, q_means)
            for q, j in enumerate(rows):
                if idx[q] >= 0 and sim[q] > sims[j]:
                    sets[j], ids[j], sims[j] = f"{name}|{kind}", index.ids[idx[q]], sim[q]
    return sets, ids, sims


# How a partition's own images are described: the thumbnail of the picture without a `border`
# resize's bars (dataplane.pictures), codes and hashes kept for the sign step. Part of each
# partition's reuse key, so a partition described by an earlier version is described again.
WITHIN_DESCRIPTOR = "thumb16-unpadded"
# How a partition's images are searched against the evaluation sets besides as a whole: a picture
# inside bars of one flat colour is searched again without them (`imagehash.trim_flat_bars`). In the
# reuse key where the stage has evaluation sets, so descriptions searched before it are searched again.
FRAMED_QUERY = "flat-bars"
# what a description file holds (3: codes, colours and hashes for the sign step; 4: `detail`; 5: the
# descriptors of a picture inside a flat frame, `framed_vec`/`framed_detail`, which removals search too)
DESCRIBED_LAYOUT = 5


def eval_search(arrays: dict) -> str:
    """How a run searches its evaluation indexes (`arrays`: kind -> set -> NearDupIndex.arrays()), as far
    as a description's matches depend on it: the inverted files' plans, and the framed query where
    there are hash sets; "" where there are no sets."""
    plans = {p for sets in arrays.values() for a in sets.values() if (p := search_plan(a))}
    return "+".join(sorted(plans | ({FRAMED_QUERY} if arrays.get("hash") else set())))


def _described_key(fingerprint: str, u, search: str = "") -> str:
    """What decides a partition's descriptions: the stage's fingerprint (config, evaluation sets),
    how images are described and what the file holds, the partition's content, and how an inexact
    evaluation index is searched (`search`: `eval_search`; where there are no evaluation sets, the
    key is what it was before searches had plans). Not the run's size: a dataset line that
    doubles keeps every description (only the cheap signatures follow the band plan)."""
    text = json.dumps([fingerprint, WITHIN_DESCRIPTOR, DESCRIBED_LAYOUT, u.part, u.sha256] + ([search] if search else []))
    return f"{u.part}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


DESCRIBED = "dedup/described"    # per partition, by what decided it: kept across runs (Stage.preserve)
