"""Measure stages against the demo's ground truth, beside them, never inside them.

The synthetic source writes `source/_ground_truth.parquet` (which sample has which planted defect).
Stages must not read it; the runner calls `after_stage` once a stage has finished on a synthetic
run, which compares the stage's ledger with the truth, prints the figures and writes
`<stage>/audit.json`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq


def _truth(run_dir: Path) -> dict[str, dict]:
    return {r["key"]: r for r in pq.read_table(run_dir / "source" / "_ground_truth.parquet").to_pylist()}


def _ledger(storage, stage: str) -> dict[str, dict]:
    from stages.base import read_ledger

    # the demo's few thousand rows: an observer of the demo may hold them
    return {r["key"]: r for r in read_ledger(storage, stage, ["key", "verdict", "reason", "score"]).to_pylist()}


def rates(ledger: dict, truth: dict, defect: str, reason_prefix: str) -> dict:
    """Recall of `defect` among samples that entered, and false drops among clean ones."""
    planted = [k for k in ledger if truth[k]["defect"] == defect]
    clean = [k for k in ledger if truth[k]["defect"] == "clean"]
    caught = sum(ledger[k]["verdict"] == "dropped" and ledger[k]["reason"].startswith(reason_prefix)
                 for k in planted)
    false = sum(ledger[k]["verdict"] == "dropped" and ledger[k]["reason"].startswith(reason_prefix) for k in clean)
    return {"planted": len(planted), "caught": caught, "recall": caught / len(planted) if planted else None,
            "clean": len(clean), "false_drops": false, "false_drop_rate": false / len(clean) if clean else None}


def roc_auc(positive: list[float], negative: list[float]) -> float | None:
    """P(score of a positive > score of a negative), ties counting half (Mann-Whitney U)."""
    if not positive or not negative:
        return None
    import numpy as np
    from scipy.stats import rankdata

    ranks = rankdata(np.concatenate([positive, negative]))
    u = ranks[: len(positive)].sum() - len(positive) * (len(positive) + 1) / 2
    return float(u / (len(positive) * len(negative)))


# stage -> [(planted defect, the reason prefix that catches it)]
def _audits() -> dict[str, tuple]:
    from stages.registry import audited   # stage -> [(planted defect, the reason prefix that catches it)]

    return audited()


def after_stage(stage: str, run_dir: Path, log=print, storage=None) -> dict | None:
    from stages.dataplane import Storage

    storage = storage or Storage.local(run_dir)
    audits = _audits()
    if stage not in audits or not (run_dir / "source" / "_ground_truth.parquet").is_file():
        return None
    ledger, truth = _ledger(storage, stage), _truth(run_dir)
    result = {}
    for defect, prefix in audits[stage]:
        r = result[defect] = rates(ledger, truth, defect, prefix)
        if r["recall"] is None:
            continue
        false = (f", false drops among clean {100 * r['false_drop_rate']:.2f}% ({r['false_drops']}/{r['clean']})"
                 if prefix else "")
        log(f"{stage} audit (demo ground truth): {defect} recall {r['recall']:.3f} "
            f"({r['caught']}/{r['planted']}){false}")
        if defect == "eval_caption":   # by how the caption was planted: exact, re-cased, inside longer text, by chance
            r["by_kind"] = {}
            for how in sorted({truth[k]["detail"].rsplit(":", 1)[-1] for k in ledger if truth[k]["defect"] == defect}):
                some = {k: v for k, v in ledger.items() if truth[k]["defect"] != defect
                        or truth[k]["detail"].rsplit(":", 1)[-1] == how}
                r["by_kind"][how] = {x: rates(some, truth, defect, prefix)[x] for x in ("planted", "caught", "recall")}
            log(f"{stage} audit (demo ground truth): {defect} by kind " + ", ".join(
                f"{how} {v['caught']}/{v['planted']}" for how, v in r["by_kind"].items()))
    if stage == "clip_score":
        # how well the score itself separates planted mismatches from clean pairs, whatever the cut
        scored = [(truth[k]["defect"], r["score"]) for k, r in ledger.items() if r["score"] is not None]
        auc = roc_auc([s for d, s in scored if d == "clean"], [s for d, s in scored if d == "mismatched_caption"])
        result["roc_auc_clean_vs_mismatched"] = auc
        if auc is not None:
            log(f"{stage} audit (demo ground truth): ROC AUC of the score, clean vs mismatched captions {auc:.3f}")
    # the working copy's tools (the report) read it there too
    storage.write_both(run_dir, f"{stage}/audit.json", json.dumps(result, indent=2).encode())
    return result
