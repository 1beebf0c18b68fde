"""`dedup/report.html`: what deduplication removed, each drop beside what it duplicates.

Within-data duplicates are shown as pairs (the dropped image, then the one kept of its cluster,
with the cosine for near duplicates); evaluation-set matches as the dropped image with the set and
item it matched. Pairs come from the components task (the first few per reason); a Ray task per input
partition that holds one of the keys shown reads those rows and images (the driver reads no
partition); evaluation matches come from the seeded pick of examples, which carries the sample index.
"""
from __future__ import annotations

import base64
import html
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..dataplane import read_images
from ..examples import stage_picks, store_picks

PAIRS_PER_REASON = 12
_STYLE = """body{font:14px sans-serif;margin:1.5em;color:#222}.pairs{display:flex;flex-wrap:wrap;gap:14px}
.pair{border:1px solid #ccc;border-radius:4px;padding:6px;display:flex;gap:6px;font-size:12px}
.pair figure{margin:0;width:130px}.pair img{width:128px;image-rendering:pixelated}.meta{color:#666}"""


def _rows_task(storage, wanted: list[tuple[str, list[str]]]) -> list[dict]:
    """Ray task: the rows (caption, sample index) and images of a few keys in each of a few input
    partitions (the pairs a report shows: at most 2 x PAIRS_PER_REASON per reason), 16 files at once."""
    from concurrent.futures import ThreadPoolExecutor

    def one(item):
        file, keys = item
        t = pq.read_table(storage.path(file), columns=["key", "caption", "tar", "offset", "size"],
                          filesystem=storage.fs, filters=[("key", "in", keys)])
        rows = t.to_pylist()
        for r, img in zip(rows, read_images(storage, t) if rows else []):
            r["image"] = img
        return rows

    with ThreadPoolExecutor(max(1, min(16, len(wanted)))) as pool:
        return [r for rows in pool.map(one, wanted) for r in rows]


def _with_images(storage, rows: list[dict]) -> dict[str, dict]:
    """key -> row with its image, for rows that carry the sample index already (a few)."""
    for r, img in zip(rows, read_images(storage, pa.Table.from_pylist(rows)) if rows else []):
        r["image"] = img
    return {r["key"]: r for r in rows}


def _rows(ctx, part_of: dict[str, str], keys: set[str]) -> dict[str, dict]:
    files = {u.part: u.file for u in ctx.upstream or []}
    wanted: dict[str, list[str]] = {}
    for k in sorted(keys):
        wanted.setdefault(part_of[k], []).append(k)
    items = [(files[p], ks) for p, ks in sorted(wanted.items())]
    found = ctx.call(_rows_task, ctx.storage, items, what="dedup report", num_cpus=0.25) if items else []
    return {r["key"]: r for r in found}


def _figure(row: dict | None, label: str) -> str:
    if not row or not row.get("image"):
        return f"<figure><div class='meta'>{html.escape(label)} (image not found)</div></figure>"
    src = base64.b64encode(row["image"]).decode()
    return (f"<figure><img alt='{html.escape(row['key'])}' src='data:image/jpeg;base64,{src}'>"
            f"<figcaption>{html.escape((row.get('caption') or '')[:100])}<div class='meta'>{html.escape(label)}"
            f"</div></figcaption></figure>")


def write_report(ctx, shown: dict[str, list], parts: list[dict]) -> Path:
    """shown: reason -> the first drops by key, each (key, cosine or None, key kept, their partitions)."""
    part_of = {k: p for pairs in shown.values() for key, _, root, pk, pr in pairs for k, p in ((key, pk), (root, pr))}
    shown = {reason: [(key, score, root) for key, score, root, _, _ in pairs] for reason, pairs in shown.items()}
    picks = stage_picks(ctx, parts, PAIRS_PER_REASON)
    store_picks(ctx, picks)          # the run report's samples of this stage
    evals = {r: rows for r, rows in picks.items() if r.startswith("eval_duplicate")}
    rows = _rows(ctx, part_of, {k for pairs in shown.values() for key, _, root in pairs for k in (key, root)})
    rows.update(_with_images(ctx.storage, [r for found in evals.values() for r in found]))
    totals = {}
    for p in parts:
        for reason, n in p.dropped.items():
            totals[reason] = totals.get(reason, 0) + n
    page = [f"<!doctype html><html><head><meta charset='utf-8'><title>Dedup: {html.escape(ctx.run_name)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>Deduplication: {html.escape(ctx.run_name)}</h1><p>"
            + ", ".join(f"{html.escape(r)}: {n}" for r, n in sorted(totals.items())) + "</p>"]
    for reason, pairs in shown.items():
        page.append(f"<h2>{html.escape(reason)} ({len(pairs)} of {totals.get(reason, len(pairs))} shown): "
                    "dropped, then the sample kept in its place</h2><div class='pairs'>")
        for key, score, root in pairs:
            sim = "" if score is None else f" · cosine {score:.3f}"
            page.append(f"<div class='pair'>{_figure(rows.get(key), f'dropped {key}{sim}')}"
                        f"{_figure(rows.get(root), f'kept {root}')}</div>")
        page.append("</div>")
    for reason, found in evals.items():
        page.append(f"<h2>{html.escape(reason)} ({len(found)} of {totals.get(reason, len(found))} shown): "
                    "dropped, with the evaluation item it matched</h2><div class='pairs'>")
        for r in found:
            score = "" if r["score"] is None else f" · cosine {r['score']:.3f}"
            page.append(f"<div class='pair'>{_figure(rows.get(r['key']), 'dropped ' + r['key'] + score)}"
                        f"<figure><div class='meta'>matched {html.escape(r['detail'] or '')}</div></figure></div>")
        page.append("</div>")
    page.append("</body></html>")
    path = ctx.stage_dir / "report.html"
    path.write_text("".join(page))
    return path
