"""A filter stage's examples page: for each drop reason (and for kept samples) up to N samples, each a
picture next to its caption, reason and score, so a person can judge the stage's choices.

Examples are picked deterministically (by sha256(seed:key)), images are read from the ingest shards
and inlined as data URIs: `<stage>/report.html` is one file that opens anywhere.
"""
from __future__ import annotations

import base64
import html
import tarfile
from collections import defaultdict
from pathlib import Path

import pyarrow as pa

from .tokenizer import order_key

_STYLE = """body{font:14px sans-serif;margin:1.5em;color:#222}h2{margin-top:1.6em}
.grid{display:flex;flex-wrap:wrap;gap:10px}.card{width:180px;border:1px solid #ccc;border-radius:4px;padding:6px}
.card img{width:100%;height:auto;image-rendering:pixelated;background:#eee}.cap{margin:4px 0;word-wrap:break-word}
.meta{color:#666;font-size:12px}"""


def read_images(ingest_dir: Path, keys: list[str]) -> dict[str, bytes]:
    """key -> image bytes as ingest stored them, for the given keys (each tar opened once)."""
    from .shard import ingest_locations

    where = ingest_locations(ingest_dir)
    by_tar: dict[str, dict[str, str]] = defaultdict(dict)
    for k in keys:
        if k in where:
            tar, member = where[k]
            by_tar[tar][f"{member}.jpg"] = k
    out = {}
    for tar, wanted in by_tar.items():
        with tarfile.open(tar) as t:
            for m in t:
                if m.name in wanted:
                    out[wanted[m.name]] = t.extractfile(m).read()
    return out


def pick(ledger: pa.Table, per_reason: int, seed: int) -> dict[str, list[dict]]:
    """reason ("kept" for kept samples) -> up to per_reason ledger rows, in a seeded order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in ledger.to_pylist():
        groups[r["reason"] or "kept"].append(r)
    return {reason: sorted(rows, key=lambda r: order_key(seed, r["key"]))[:per_reason]
            for reason, rows in sorted(groups.items())}


def render_html(title: str, groups: dict[str, list[dict]], totals: dict[str, int],
                captions: dict[str, str], images: dict[str, bytes]) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"]
    parts.append("<p>" + ", ".join(f"<a href='#{html.escape(r)}'>{html.escape(r)}</a>: {totals[r]}"
                                   for r in groups) + "</p>")
    for reason, rows in groups.items():
        parts.append(f"<h2 id='{html.escape(reason)}'>{html.escape(reason)} "
                     f"({len(rows)} of {totals[reason]} shown)</h2><div class='grid'>")
        for r in rows:
            img = images.get(r["key"])
            src = f"data:image/jpeg;base64,{base64.b64encode(img).decode()}" if img else ""
            score = "" if r["score"] is None else f" · score {r['score']:.4g}"
            detail = f"<div class='meta'>{html.escape(r['detail'][:200])}</div>" if r["detail"] else ""
            parts.append(f"<div class='card'><img alt='{html.escape(r['key'])}' src='{src}'>"
                         f"<div class='cap'>{html.escape(captions.get(r['key'], ''))}</div>"
                         f"<div class='meta'>{html.escape(r['key'])}{score}</div>{detail}</div>")
        parts.append("</div>")
    parts.append("</body></html>")
    return "".join(parts)


def write_examples(ctx, ledger: pa.Table, captions: dict[str, str], per_reason: int, title: str) -> Path:
    groups = pick(ledger, per_reason, ctx.config.seed)
    totals = defaultdict(int)
    for reason in ledger.column("reason").to_pylist():
        totals[reason or "kept"] += 1
    keys = [r["key"] for rows in groups.values() for r in rows]
    images = read_images(ctx.upstream["ingest"], keys)
    path = ctx.stage_dir / "report.html"
    path.write_text(render_html(f"{title}: {ctx.config.name}", groups, totals, captions, images))
    return path
