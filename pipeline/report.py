"""`capline report RUN_DIR`: one self-contained `report.html` for a person to look at after a run.

Sections: the funnel (in, kept, % kept, wall time, dropped by reason per stage, and a link to each
stage's own report: ingest failures by host, dedup pairs side by side, the filters' samples nearest
their cuts), the demo's audit against its planted defects, score histograms with the thresholds the
run used (each score means one thing for kept and dropped alike), a grid of kept and dropped samples
(picture, caption, reason, score; at most MAX_PER_REASON per stage and reason), training curves from
MLflow, and the evaluation table with every shot count. Charts are PNGs drawn with matplotlib and inlined, so the page
needs no network and no script beyond one check that logs an error for any image that fails to load.
Everything comes from what the stages stored (stats.json's score histograms, each stage's picks.json):
the report reads no ledger, so its time does not grow with the number of partitions.
"""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np

from infra.errors import UserError

from .inspect_run import format_status, status_rows

from stages.registry import judging

FILTER_STAGES = tuple(s.name for s in judging())
MAX_PER_REASON = 50   # cards per stage and reason: the page stays a few MB (images are inlined)
_CHECK_IMAGES = ("<script>window.addEventListener('load',()=>{document.querySelectorAll('img').forEach(i=>{"
                 "if(!i.complete||!i.naturalWidth)console.error('image did not load: '+i.alt)})})</script>")
_STYLE = """body{font:14px sans-serif;margin:1.5em;color:#222;max-width:1300px}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#f3f3f3}h2{margin-top:1.8em}
.grid{display:flex;flex-wrap:wrap;gap:8px}.card{width:150px;border:1px solid #ccc;border-radius:4px;padding:5px;font-size:12px}
.card img{width:100%;image-rendering:pixelated}.kept{border-color:#3a3}.dropped{border-color:#c33}.meta{color:#666}"""


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f"<img alt='chart' src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'>"


def _funnel_chart(rows: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["in"] is not None]
    if not done:
        return ""
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(done) + 1))
    names = [r["stage"] for r in done][::-1]
    ax.barh(names, [r["kept"] for r in done][::-1], color="#4a4", label="kept")
    ax.barh(names, [r["in"] - r["kept"] for r in done][::-1], left=[r["kept"] for r in done][::-1],
            color="#c44", label="dropped")
    ax.set_xlabel("samples")
    ax.legend(loc="lower right")
    return _png(fig)


def _score_charts(run_dir: Path, config: dict) -> list[str]:
    """Per filter stage with scores: a histogram of kept and dropped scores and the cut it used."""
    import matplotlib.pyplot as plt

    from stages.registry import STAGES

    out = []
    sections = config.get("stages", {})
    for spec in (s for s in STAGES if s.score_cuts is not None):   # the stages whose scores share one axis
        stage = spec.name
        # the histogram the stage's tasks binned (stats.json): the report never reads a ledger
        path = run_dir / stage / "stats.json"
        stats = json.loads(path.read_text()) if path.is_file() else {}
        hist = stats.get("score_hist")
        if not hist or sum(hist.get("kept", [])) + sum(hist.get("dropped", [])) < 2:
            continue
        lo, hi = hist["range"]
        edges = np.linspace(lo, hi, hist["bins"] + 1)
        kept, dropped = (np.asarray(hist.get(v, [0] * hist["bins"])) for v in ("kept", "dropped"))
        used = np.flatnonzero(kept + dropped)
        view = (edges[used[0]], edges[used[-1] + 1])     # the bins that hold scores, not all of [-1, 1]
        lines = spec.cut_lines(sections.get(spec.config_key or stage, {}), stats)
        fig, ax = plt.subplots(figsize=(6, 2.6))
        ax.stairs(kept, edges, fill=True, color="#4a4", label="kept")
        ax.stairs(kept + dropped, edges, baseline=kept, fill=True, color="#c44", label="dropped")
        ax.set_xlim(*view)
        for (label, cut), style in zip(lines, ("--", ":")):
            if cut is not None:
                ax.axvline(cut, color="k", linestyle=style, label=f"{label} = {cut:.3g}")
        ax.set_title(f"{stage} score")
        ax.legend(fontsize=8)
        out.append(_png(fig))
    return out


def _sample_grid(storage, seed: int, per_reason: int) -> str:
    import pyarrow as pa

    from stages.dataplane import read_images
    from stages.examples import stored_picks

    parts = []
    for stage in FILTER_STAGES:
        groups = stored_picks(storage, stage, per_reason)     # what the stage picked: one read, no ledger
        if groups is None:
            continue
        rows = [r for rs in groups.values() for r in rs]
        found = read_images(storage, pa.Table.from_pylist(rows)) if rows else []
        images = {r["key"]: b for r, b in zip(rows, found) if b is not None}
        captions = {r["key"]: r.get("caption") or "" for r in rows}
        parts.append(f"<h3>{stage}</h3><div class='grid'>")
        for reason, rows in groups.items():
            for r in rows:
                if r["key"] not in images:
                    continue
                src = base64.b64encode(images[r["key"]]).decode()
                score = "" if r["score"] is None else f" · {r['score']:.3g}"
                cls = "kept" if reason == "kept" else "dropped"
                parts.append(f"<div class='card {cls}'><img alt='{html.escape(r['key'])}' "
                             f"src='data:image/jpeg;base64,{src}'><div>{html.escape(captions.get(r['key'], '')[:120])}</div>"
                             f"<div class='meta'>{html.escape(reason)}{score}</div></div>")
        parts.append("</div>")
    return "".join(parts)


def _training(run_dir: Path, manifest: dict) -> str:
    run_id = manifest.get("mlflow_runs", {}).get("train")
    if not run_id:
        return "<p>No training run in this run folder.</p>"
    try:
        import matplotlib.pyplot as plt

        from infra.tracking import client, tracking_uri

        c = client(tracking_uri(run_dir))
        keys = sorted(k for k in c.get_run(run_id).data.metrics if "loss" in k or k.startswith("lr"))
        fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4 * max(1, len(keys)), 2.6), squeeze=False)
        for ax, key in zip(axes[0], keys):
            hist = sorted(c.get_metric_history(run_id, key), key=lambda m: m.step)
            ax.plot([m.step for m in hist], [m.value for m in hist])
            ax.set_title(key)
            ax.set_xlabel("step")
        return f"<p>MLflow run {html.escape(run_id)}</p>" + _png(fig)
    except Exception as err:  # noqa: BLE001 - a report without curves is still a report; say why
        return f"<p>Training curves unavailable: {html.escape(type(err).__name__)}: {html.escape(str(err)[:200])}</p>"


def _evaluation(run_dir: Path) -> str:
    found = sorted((run_dir / "eval").glob("*.json")) if (run_dir / "eval").is_dir() else []
    results = [json.loads(p.read_text()) for p in found if p.name not in ("stats.json", "parts.json")]
    results = [r for r in results if isinstance(r, dict) and "model" in r]
    if not results:
        return "<p>No evaluation in this run folder.</p>"
    from trainers.evaluation.run import eval_rows   # imports torch (~3 s): only for a run that has results

    out = []
    for res in results:
        rows = eval_rows(res)
        out.append(f"<h3>{html.escape(res['model'])}/{html.escape(res['size'])}</h3>")
        for variant, title in (("linear", "Few-shot linear probe"), ("map", "Few-shot MAP-head probe")):
            fewshot = [r for r in rows if r["task"] == "few-shot" and r["variant"] == variant]
            shots = sorted({r["shots"] for r in fewshot})
            if not fewshot:
                continue
            head = "".join(f"<th>{k}-shot</th>" for k in shots)
            body = []
            for name in dict.fromkeys(r["dataset"] for r in fewshot):
                cells = {r["shots"]: r for r in fewshot if r["dataset"] == name}
                body.append(f"<tr><td>{html.escape(name)}</td>" + "".join(
                    f"<td>{100 * cells[k]['value']:.1f}% &plusmn; {100 * (cells[k]['std'] or 0):.1f}</td>" if k in cells
                    else "<td>-</td>" for k in shots) + "</tr>")
            out.append(f"<p>{title} (accuracy, mean &plusmn; std over seeds)</p><table><tr>"
                       f"<th>dataset</th>{head}</tr>{''.join(body)}</table>")
        other = [r for r in rows if r["task"] != "few-shot"]
        if other:
            out.append("<p>Captioning, zero-shot and word order</p><table><tr><th>task</th><th>set</th>"
                       "<th>variant</th><th>metric</th><th>value</th></tr>" + "".join(
                           f"<tr><td>{html.escape(r['task'])}</td><td>{html.escape(str(r['dataset']))}</td>"
                           f"<td>{html.escape(str(r['variant']))}</td><td>{html.escape(r['metric'])}</td>"
                           f"<td>{r['value']:.3f}</td></tr>" for r in other) + "</table>")
        if res.get("skipped"):
            out.append("<p>Skipped:</p><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in res["skipped"]) + "</ul>")
    return "".join(out)


def _audit(run_dir: Path) -> str:
    """The demo's audit (pipeline/audit.py): each filter against the defects the demo planted."""
    tables = []
    for stage in FILTER_STAGES:
        path = run_dir / stage / "audit.json"
        if not path.is_file():
            continue
        audit = json.loads(path.read_text())
        body = []
        for defect, a in audit.items():
            if not isinstance(a, dict):
                shown = f"{a:.3f}" if isinstance(a, float) else str(a)
                body.append(f"<tr><td>{html.escape(defect)}</td><td colspan='4'>{html.escape(shown)}</td></tr>")
                continue
            rate, recall = a.get("false_drop_rate"), a.get("recall")
            cells = (defect, f"{a.get('caught', '-')}/{a.get('planted', '-')}",
                     "-" if recall is None else f"{recall:.3f}", f"{a.get('false_drops', '-')}/{a.get('clean', '-')}",
                     "-" if rate is None else f"{100 * rate:.2f}%")
            body.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
        tables.append(f"<h3>{stage}</h3><table><tr><th>planted defect</th><th>caught</th><th>recall</th>"
                      f"<th>clean dropped</th><th>false drop rate</th></tr>{''.join(body)}</table>")
    return "".join(tables)


def write_report(run_dir: Path, per_reason: int = 6, storage=None) -> Path:
    """`report.html` in the working copy; the ledgers and images are read where they are (`storage`:
    the run folder's, default the local folder itself)."""
    from stages.dataplane import Storage

    storage = storage or Storage.local(run_dir)
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.is_file():
        raise UserError(f"{run_dir}: not a capline run folder (no manifest.json)")
    manifest = json.loads(manifest_path.read_text())
    config = manifest.get("config", {})
    if not 0 <= per_reason <= MAX_PER_REASON:
        raise UserError(f"--per-reason {per_reason}: choose 0..{MAX_PER_REASON} samples per stage and reason "
                        "(each stage's own report shows more)")
    rows = status_rows(run_dir)
    title = f"capline run report: {config.get('name', run_dir.name)}"
    table = ["<table><tr><th>stage</th><th>state</th><th>in</th><th>kept</th><th>% kept</th><th>wall</th>"
             "<th>dropped by reason</th><th>stage report</th></tr>"]
    for r in rows:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted((r["dropped"] or {}).items(), key=lambda kv: -kv[1]))
        pct = f"{100 * r['kept'] / r['in']:.1f}%" if r["in"] else "-"
        wall = f"{r['wall_seconds']:.1f}s" if r["wall_seconds"] is not None else "-"
        link = (f"<a href='{r['stage']}/report.html'>{r['stage']}/report.html</a>"
                if (run_dir / r["stage"] / "report.html").is_file() else "")
        table.append(f"<tr><td>{r['stage']}</td><td>{r['state']}</td><td>{r['in'] if r['in'] is not None else '-'}</td>"
                     f"<td>{r['kept'] if r['kept'] is not None else '-'}</td><td>{pct}</td><td>{wall}</td>"
                     f"<td>{html.escape(reasons or '-')}</td><td>{link}</td></tr>")
    table.append("</table>")
    card = run_dir / "shard" / "README.md"
    if card.is_file():
        table.append("<p>Dataset card: <a href='shard/README.md'>shard/README.md</a></p>")
    page = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style>{_CHECK_IMAGES}</head><body><h1>{html.escape(title)}</h1>",
            f"<p>Run folder {html.escape(str(run_dir))}; config {html.escape(manifest.get('config_hash', '')[:12])}, "
            f"capline {html.escape(str(manifest.get('git_revision', ''))[:12])}.</p>",
            "<h2>Funnel</h2>", "".join(table), _funnel_chart(rows),
            *(("<h2>Audit against the demo's planted defects</h2>", audit) if (audit := _audit(run_dir)) else ()),
            "<h2>Scores and thresholds</h2>", "".join(_score_charts(run_dir, config)) or "<p>No scores yet.</p>",
            "<h2>Samples kept and dropped</h2>", _sample_grid(storage, int(config.get("seed", 0)), per_reason),
            "<h2>Training</h2>", _training(run_dir, manifest),
            "<h2>Evaluation</h2>", _evaluation(run_dir),
            f"<h2>Status as text</h2><pre>{html.escape(format_status(rows))}</pre></body></html>"]
    out = run_dir / "report.html"
    out.write_text("".join(page))
    return out
