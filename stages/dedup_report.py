"""`dedup/report.html`: what deduplication removed, each drop beside what it duplicates.

Within-data duplicates are shown as pairs (the dropped image, then the one kept of its cluster,
with the cosine for near duplicates); evaluation-set matches as the dropped image with the set and
item it matched. Pairs come from the driver's decisions (a few per reason), images through the
sample index of the stage's input partitions, only for the keys shown.
"""
from __future__ import annotations

import base64
import html
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .dataplane import read_images
from .examples import pick

PAIRS_PER_REASON = 12
_STYLE = """body{font:14px sans-serif;margin:1.5em;color:#222}.pairs{display:flex;flex-wrap:wrap;gap:14px}
.pair{border:1px solid #ccc;border-radius:4px;padding:6px;display:flex;gap:6px;font-size:12px}
.pair figure{margin:0;width:130px}.pair img{width:128px;image-rendering:pixelated}.meta{color:#666}"""


def _rows(storage, upstream: list[dict], keys: set[str]) -> dict[str, dict]:
    """key -> its input row (caption and sample index) for the few keys shown."""
    out = {}
    for u in upstream:
        t = pq.read_table(storage.path(u["file"]), columns=["key", "caption", "tar", "offset", "size"],
                          filesystem=storage.fs, filters=[("key", "in", sorted(keys))])
        for r in t.to_pylist():
            out[r["key"]] = r
    images = read_images(storage, pa.Table.from_pylist(list(out.values()))) if out else []
    for r, img in zip(list(out.values()), images):
        r["image"] = img
    return out


def _figure(row: dict | None, label: str) -> str:
    if not row or not row.get("image"):
        return f"<figure><div class='meta'>{html.escape(label)} (image not found)</div></figure>"
    src = base64.b64encode(row["image"]).decode()
    return (f"<figure><img alt='{html.escape(row['key'])}' src='data:image/jpeg;base64,{src}'>"
            f"<figcaption>{html.escape((row.get('caption') or '')[:100])}<div class='meta'>{html.escape(label)}"
            f"</div></figcaption></figure>")


def write_report(ctx, decisions: dict[str, dict], parts: list[dict]) -> Path:
    flat = sorted((k, *v) for d in decisions.values() for k, v in d.items())   # (key, reason, score, root)
    shown: dict[str, list] = {}
    for key, reason, score, root in flat:
        if len(shown.setdefault(reason, [])) < PAIRS_PER_REASON:
            shown[reason].append((key, score, root))
    evals = {r: rows for r, rows in pick(ctx.storage, [p["file"] for p in parts], PAIRS_PER_REASON,
                                        ctx.config.seed).items() if r.startswith("eval_duplicate")}
    keys = {k for rows in shown.values() for k, _, root in rows for k in (k, root)}
    keys |= {r["key"] for rows in evals.values() for r in rows}
    rows = _rows(ctx.storage, ctx.upstream or [], keys) if keys else {}
    totals = {}
    for p in parts:
        for reason, n in p["dropped"].items():
            totals[reason] = totals.get(reason, 0) + n
    page = [f"<!doctype html><html><head><meta charset='utf-8'><title>Dedup: {html.escape(ctx.config.name)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>Deduplication: {html.escape(ctx.config.name)}</h1><p>"
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
