"""A filter stage's examples page: for each drop reason (and for kept samples) up to N samples, each a
picture next to its caption, reason and score, so a person can judge the stage's choices.

Examples are picked deterministically: for a stage with one cut (language, CLIP score) the samples
nearest it on each side, the ones a person can argue about; otherwise by sha256(seed:key). Each
partition picks in its own task; images
are read from the ingest shards through the sample index and inlined as data URIs: `<stage>/report.html` is one file that opens anywhere.
"""
from __future__ import annotations

import base64
import html
from collections import defaultdict
from pathlib import Path

from .picks import COLUMNS, order, pick_rows

_STYLE = """body{font:14px sans-serif;margin:1.5em;color:#222}h2{margin-top:1.6em}
.grid{display:flex;flex-wrap:wrap;gap:10px}.card{width:180px;border:1px solid #ccc;border-radius:4px;padding:6px}
.card img{width:100%;height:auto;image-rendering:pixelated;background:#eee}.cap{margin:4px 0;word-wrap:break-word}
.meta{color:#666;font-size:12px}"""


EXAMPLES = "examples"    # each partition's picks, by its file's content: kept across runs (Stage.preserve)


def _pick_task(storage, file: str, per_reason: int, seed: int, cut: float | None = None) -> dict[str, list[dict]]:
    """Ray task: one partition's picks, read from its ledger (a partition whose writing task did not
    pick: written by an earlier version, or `capline report` on a finished run)."""
    return pick_rows(storage.read_table(file, COLUMNS), per_reason, seed, cut)


def _kept_pick(storage, file: str, per_reason: int, seed: int, cut: float | None, out: str) -> dict:
    """Ray task: a partition's picks, kept as `<out>.json` for a later run that finds it unchanged."""
    found = _pick_task(storage, file, per_reason, seed, cut)
    storage.write_json(f"{out}.json", found)
    return found


def _merged(results, per_reason: int, seed: int, cut: float | None) -> dict[str, list[dict]]:
    """The partitions' picks -> up to per_reason rows per reason over all of them."""
    merged: dict[str, list[dict]] = defaultdict(list)
    for found in results:
        for reason, rows in found.items():
            merged[reason] = sorted(merged[reason] + rows, key=order(seed, cut))[:per_reason]
    return dict(sorted(merged.items()))


def pick(storage, files: list[str], per_reason: int, seed: int, cut: float | None = None) -> dict[str, list[dict]]:
    """reason ("kept" for kept samples) -> up to per_reason rows over all partitions, nearest the
    cut if there is one, else in a seeded order, one partition at a time here (`capline report` on
    a finished run, no cluster; a stage picks in tasks: `stage_picks`)."""
    return _merged((_pick_task(storage, f, per_reason, seed, cut) for f in files), per_reason, seed, cut)


def stage_picks(ctx, parts: list, per_reason: int, cut: float | None = None) -> dict[str, list[dict]]:
    """`pick` over a stage's own partitions (its PartResults), kept by partition (`<stage>/examples/`,
    by the ledger file's content and the choice): a partition picked before is not read again (a
    scheduled run picks from what it added), one whose writing task picked with the same choice
    (`PartResult.picks`, see dataplane.write_part) is not read at all, and only the rest are read,
    each in a task."""
    import hashlib
    import json

    from .dataplane import reused_or_run

    def key(p) -> str:
        return hashlib.sha256(json.dumps([p.sha256, per_reason, ctx.seed, cut]).encode()).hexdigest()[:24]

    choice = [per_reason, ctx.seed, cut]
    given = {p.part: p.picks["groups"] for p in parts
             if getattr(p, "picks", None) is not None and p.picks["choice"] == choice}
    found, _ = reused_or_run(ctx, _kept_pick, f"{ctx.name}/{EXAMPLES}", key,
                             lambda p, out: (ctx.storage, p.file, per_reason, ctx.seed, cut, out), "examples",
                             "picked before from the same ledger", "pick", items=parts, given=given,
                             num_cpus=0.25, quiet=True)
    return _merged(found, per_reason, ctx.seed, cut)


def render_html(title: str, groups: dict[str, list[dict]], totals: dict[str, int],
                images: dict[str, bytes], cut: float | None = None) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"]
    if cut is not None:
        # six digits: scores are kept to 1e-6, and the samples nearest a cut differ in the fourth
        parts.append(f"<p>Shown: the samples whose score is nearest the cut {cut:.6g}, on each side of it.</p>")
    parts.append("<p>" + ", ".join(f"<a href='#{html.escape(r)}'>{html.escape(r)}</a>: {totals[r]}"
                                   for r in groups) + "</p>")
    for reason, rows in groups.items():
        parts.append(f"<h2 id='{html.escape(reason)}'>{html.escape(reason)} "
                     f"({len(rows)} of {totals[reason]} shown)</h2><div class='grid'>")
        for r in rows:
            img = images.get(r["key"])
            src = f"data:image/jpeg;base64,{base64.b64encode(img).decode()}" if img else ""
            score = "" if r["score"] is None else f" · score {r['score']:.6g}"
            detail = f"<div class='meta'>{html.escape(r['detail'][:200])}</div>" if r["detail"] else ""
            parts.append(f"<div class='card'><img alt='{html.escape(r['key'])}' src='{src}'>"
                         f"<div class='cap'>{html.escape(r.get('caption') or '')}</div>"
                         f"<div class='meta'>{html.escape(r['key'])}{score}</div>{detail}</div>")
        parts.append("</div>")
    parts.append("</body></html>")
    return "".join(parts)


PICKS = "picks.json"      # <stage>/picks.json: the stage's merged picks, what the run report shows


def store_picks(ctx, groups: dict[str, list[dict]]) -> None:
    ctx.storage.write_json(f"{ctx.name}/{PICKS}", groups)


def stored_picks(storage, stage: str, per_reason: int) -> dict[str, list[dict]] | None:
    """The first `per_reason` of each reason the stage picked (in its order); None if it stored none."""
    groups = storage.read_json(f"{stage}/{PICKS}")
    return None if groups is None else {reason: rows[:per_reason] for reason, rows in groups.items()}


def write_examples(ctx, parts: list[dict], per_reason: int, title: str, cut: float | None = None) -> Path:
    """`<stage>/report.html` from the stage's partitions (its PartResults); `cut`: the stage's one
    threshold on its score, if it has one."""
    from .dataplane import read_images

    groups = stage_picks(ctx, parts, per_reason, cut) if per_reason else {}
    store_picks(ctx, groups)
    totals: dict[str, int] = defaultdict(int)
    for p in parts:
        totals["kept"] += p.kept
        for reason, n in p.dropped.items():
            totals[reason] += n
    rows = [r for rs in groups.values() for r in rs]
    import pyarrow as pa

    found = read_images(ctx.storage, pa.Table.from_pylist(rows)) if rows else []
    images = {r["key"]: b for r, b in zip(rows, found) if b is not None}
    path = ctx.stage_dir / "report.html"
    path.write_text(render_html(f"{title}: {ctx.run_name}", groups, dict(totals), images, cut))
    return path
