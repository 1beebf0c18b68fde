"""The dataset card, `shard/README.md`: what a finished dataset is, for whoever finds the shards.

Written after the shard stage (an observer), from the manifest and each stage's stats: counts per
stage with wall time, every filter's thresholds, the scorer's and tokenizer's sha256, the
evaluation sets the data was decontaminated against, the source's fingerprint, the shard digest,
and the lines open_clip and wids take.
"""
from __future__ import annotations

import dataclasses
import html
import json
import re

from stages.registry import STAGES

FILTERS = tuple(s.name for s in STAGES if s.thresholds)


def thresholds(cfg) -> dict[str, dict]:
    """Each filtering stage's config section, as the run used it."""
    out = {}
    for name in FILTERS:
        section = getattr(cfg.stages, name, None)
        if section is not None and dataclasses.is_dataclass(section):
            # an unset value that only says "moved to another stage" (ingest's old size bounds) is no threshold
            from stages.base import deciding

            # what decides, not how the work was cut (HOW), nor an unset value that only says "moved"
            out[name] = {k: v for k, v in deciding(section).items() if not (name == "ingest" and v is None)}
    where = getattr(getattr(cfg, "source", None), "where", None)
    if where:     # bounds on the list's own columns (source.where): thresholds like a filter's
        out["source"] = {"where": where}
    return out


def open_clip_args(manifest: dict) -> str | None:
    shard = manifest.get("artifacts", {}).get("shard") or {}
    if not shard.get("train_data"):
        return None
    n = sum(s["samples"] for s in shard["shards"])
    return f"--train-data '{shard['train_data']}' --train-num-samples {n} --dataset-type webdataset"


def open_clip_example(manifest: dict) -> str:
    """What the printed open_clip line adds so it runs when pasted (a small model; change to taste):
    a batch no larger than the dataset (a power of two, at most 256)."""
    shard = manifest.get("artifacts", {}).get("shard") or {}
    n = sum(s["samples"] for s in shard.get("shards", [])) or 256
    batch = 1 << max(0, min(8, n.bit_length() - 1))
    return f"--model ViT-B-32 --batch-size {batch} --epochs 1 --workers 4"


def md_code(text) -> str:
    """Inline code that holds any text: a fence of more backticks than the text's longest run (file
    names and columns come from the user's data and may hold backticks)."""
    text = str(text).replace("\n", " ")
    fence = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def md_text(text) -> str:
    """Text from the data as Markdown text: its markup and HTML shown, never rendered."""
    text = html.escape(str(text).replace("\n", " "), quote=False)
    return re.sub(r"([\\`*\[\]|])", r"\\\1", text)     # table cells, code, emphasis, links


def card(manifest: dict, summary: dict, cfg) -> str:
    shard = manifest["artifacts"].get("shard", {})
    digest = manifest["stages"]["shard"]["output_digest"]
    n = sum(s["samples"] for s in shard.get("shards", []))
    lines = [f"# {md_text(cfg.name)}: {n} image-text pairs in {len(shard.get('shards', []))} WebDataset shards", "",
             f"- shard digest: `{digest}`",
             f"- config hash: `{manifest.get('config_hash')}`, seed {cfg.seed}, capline git `{manifest.get('git_revision')}`",
             f"- source: {md_code(json.dumps(manifest.get('inputs', {}), sort_keys=True))}", "",
             "## Funnel", "", "| stage | in | kept | % kept | wall s | dropped by reason |", "|---|---:|---:|---:|---:|---|"]
    for stage in [s.name for s in STAGES]:
        st = summary.get(stage)
        if not st:
            continue
        pct = f"{100 * st['kept'] / st['in']:.1f}" if st.get("in") else "-"
        reasons = ", ".join(f"{md_text(k)}={v}" for k, v in sorted(st["dropped"].items(), key=lambda kv: -kv[1])) or "-"
        lines.append(f"| {stage} | {st['in']} | {st['kept']} | {pct} | {st.get('wall_seconds', 0):.1f} | {reasons} |")
    rebuilt = manifest.get("rebuild")
    if rebuilt:
        d = rebuilt.get("drift", {})
        lines += ["", "## Rebuild", "",
                  f"Rebuilt on {md_text(rebuilt.get('at'))} from {md_code(rebuilt.get('of'))} (its shard digest "
                  f"`{rebuilt.get('original_digest')}`). Drift since the original downloads: {d.get('died', 0)} URLs died, "
                  f"{d.get('changed', 0)} changed content, {d.get('revived', 0)} came back (`drift.json`, every URL in "
                  "`drift/`)."]
    removals = manifest.get("removals") or []
    if removals:
        lines += ["", "## Removals", "", "Samples taken out of this dataset line after it was published "
                  "(`capline remove`); later runs drop what each list names, near copies included.", "",
                  "| removal | at | reason | entries | samples removed | shards rewritten |", "|---:|---|---|---|---:|---|"]
        for r in removals:
            entries = ", ".join(f"{n} {k}" for k, n in r.get("entries", {}).items() if n)
            lines.append(f"| {r.get('removal')} | {md_text(r.get('at'))} | {md_text(r.get('reason'))} | {entries} | "
                         f"{r.get('removed')} | {md_text(', '.join(r.get('shards', [])) or '-')} |")
    lines += ["", "## Filters and thresholds", ""]
    for name, section in thresholds(cfg).items():
        if name == "dedup":
            section = {k: v for k, v in section.items() if k != "eval_sets"}
        lines.append(f"- **{name}**: " + ", ".join(f"{k}={md_code(json.dumps(v))}" for k, v in section.items()))
    art = manifest["artifacts"]
    if art.get("clip_score", {}).get("scorer_sha256"):
        lines.append(f"- CLIP-score scorer sha256: `{art['clip_score']['scorer_sha256']}`")
    if art.get("tokenizer", {}).get("sha256"):
        lines.append(f"- tokenizer `{art['tokenizer']['model']}` ({art['tokenizer'].get('vocab_size')} pieces), "
                     f"sha256 `{art['tokenizer']['sha256']}`")
    dedup = summary.get("dedup") or {}
    if dedup.get("eval_sets"):
        # the level the stage warns past, as the run had it (a run before it was recorded: not said)
        warn = next((i["alike_warn"] for i in dedup["eval_sets"].values() if "alike_warn" in i), None)
        past = "" if warn is None else (f" (past {100 * warn:g} %, images of its kind that are not in it are "
                                        "removed too)")
        lines += ["", "## Evaluation sets removed", "", "Alike: the share of a set's images with another of its "
                  f"images within the dedup threshold{past}.", "", "| set | images | samples removed | alike |",
                  "|---|---:|---:|---:|"]
        for name, info in dedup["eval_sets"].items():
            alike = info.get("alike")
            lines.append(f"| {md_text(name)} | {info.get('images')} | {dedup.get('eval_matches', {}).get(name, 0)} | "
                         f"{'-' if alike is None else f'{alike:.0%}'} |")
    lines += ["", "## Reading it", "", "Each sample: `<key>.jpg`, `<key>.txt` (caption), `<key>.json` (img2dataset's "
              "fields plus `clip_score`, `language_score`). Beside the tars: `sizes.json` (open_clip), "
              "`shardindex.json` (wids).", ""]
    args = open_clip_args(manifest)
    if args:
        lines += ["```", f"python -m open_clip_train.main {args} {open_clip_example(manifest)}", "```", ""]
    return "\n".join(lines)
