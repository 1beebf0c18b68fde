"""Step 7: each partition's verdicts from the decisions, the evaluation matches and captions, and removals."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from infra.shuffle import read_bucket

from ..dataplane import DROPPED, KEPT
from .layout import DECISIONS, DECISION_SCHEMA
from .config import DedupConfig, eval_hit


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


_INDEXES: dict = {}     # (captions file, its digest, ngram, min_words) -> CaptionIndex, per worker process


def _caption_index(storage, captions: tuple, cfg: DedupConfig):
    """The evaluation captions' index, built once per worker process and kept for the stage's later
    verdict tasks there (built in every task, an 11.6 MB caption cost 11.8 s and 554 MB each time)."""
    from .caption_match import CaptionIndex

    key = (storage.uri(captions[0]), captions[1], cfg.caption_ngram, cfg.caption_min_words)
    if key not in _INDEXES:
        index = CaptionIndex(ngram=cfg.caption_ngram, min_words=cfg.caption_min_words)
        t = storage.read_table(captions[0])
        for s, i, c in zip(*(t.column(x).to_pylist() for x in ("set", "id", "caption"))):
            index.add(s, i, c)
        _INDEXES.clear()        # one stage's index at a time: a new digest replaces the old
        _INDEXES[key] = index
    return _INDEXES[key]


def _verdicts(table: pa.Table, part: str, index: int, has_decisions: bool, cfg: DedupConfig,
              storage=None, desc: str = "", removals: str | None = None,
              captions: tuple | None = None) -> tuple[pa.Table, dict]:
    """A partition's verdicts: undecodable, removed from the dataset line (`removals`: the line
    records some), evaluation-set matches, then its within-data duplicates (its row group of the
    components task's file)."""
    desc = storage.read_table(desc, ["key", "ok", "eval_set", "eval_id", "eval_sim"] + (["vec", "detail", "framed_vec", "framed_detail"] if removals else []))
    removed = {}
    if removals:
        from ..shard.removals import blocked, framed_of

        keys = desc.column("key").to_pylist()
        removed = blocked(storage, table, dict(zip(keys, desc.column("vec").to_pylist())),
                          dict(zip(keys, desc.column("detail").to_pylist())), digest=removals, framed=framed_of(desc))
        desc = desc.drop_columns(["vec", "detail", "framed_vec", "framed_detail"])
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
        elif eval_hit(set_kind, sim, cfg):
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
