"""The filter stages for real: the demo's planted defects against its ground truth, reproducibility,
a trusted-subset scorer, and the openclipart source through the whole data pipeline.

Real Ray, real img2dataset on loopback, real fastText and a really trained bootstrap scorer.
"""
import json
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import ROOT, capline, eval_index_cache
from stages.base import read_ledger

pytestmark = pytest.mark.slow

CACHE = ["--set", f"stages.dedup.cache_dir={eval_index_cache()}"]


def _kept(run_dir, stage):
    t = read_ledger(run_dir, stage).to_pylist()
    return sorted(r["key"] for r in t if r["verdict"] == "kept")


def _status_row(run_dir, stage):
    out = capline("status", str(run_dir))
    assert out.returncode == 0, out.stderr
    cells = next(ln for ln in out.stdout.splitlines() if ln.startswith(stage + " ")).split()
    assert cells[1] == "done" and int(cells[2]) == int(cells[3]) + int(cells[4]), cells
    return cells


@pytest.fixture(scope="module")
def demo_filtered(tmp_path_factory):
    """The demo as `make demo` configures it (2,000 samples), with a short training (30 steps) and one
    few-shot set of its five (the evaluation is tested in tests/trainers; here it is printed once)."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    one_set = "[{name: demo_shape, kind: parquet, path: source/eval/eval.parquet, image_col: path, label_col: shape}]"
    proc = capline("run", str(ROOT / "configs" / "demo.yaml"), "--run-dir", str(run_dir), "--set", "train.steps=30",
                   "--set", "train.checkpoint_every=30", "--set", "train.sample_every=30",
                   "--set", f"eval.fewshot={one_set}", *CACHE, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc.stdout


def test_language_stage_against_ground_truth(demo_filtered):
    run_dir, out = demo_filtered
    audit = json.loads((run_dir / "language" / "audit.json").read_text())["non_english"]
    print(f"language: recall {audit['recall']:.3f}, false drops {audit['false_drop_rate']:.4f}")
    assert audit["planted"] >= 100
    assert audit["recall"] >= 0.95
    assert audit["false_drop_rate"] < 0.01
    assert "language audit (demo ground truth): non_english recall" in out
    stats = json.loads((run_dir / "language" / "stats.json").read_text())
    assert stats["backend"] == "fasttext" and stats["model"].endswith("lid.176.ftz")
    assert all(r.startswith("language") for r in stats["dropped"])
    _status_row(run_dir, "language")
    # the models ran on actor pools, a copy an actor, never more actors than partitions or CPUs
    for stage, what in (("language", "language"), ("clip_score", "clip_score"), ("dedup", "dedup describe")):
        tasks = json.loads((run_dir / stage / "stats.json").read_text())["tasks"]
        pool = [r for r in tasks if r["what"] == what and "model" in r]
        assert len(pool) == 1 and 1 <= pool[0]["actors"] <= min(pool[0]["tasks"], pool[0]["cluster_cpus"] / pool[0]["cpus_per_task"]), tasks


def test_evaluation_captions_planted_in_alt_text_are_dropped_and_clean_captions_kept(demo_filtered):
    """#38: the demo plants held-out captions in alt-text (exact, re-cased, inside longer text; some
    clean captions hold one by chance): dedup finds >= 95 % of them and drops < 0.5 % of clean ones."""
    run_dir, out = demo_filtered
    audit = json.loads((run_dir / "dedup" / "audit.json").read_text())["eval_caption"]
    print(f"eval captions in alt-text: recall {audit['recall']:.3f} ({audit['caught']}/{audit['planted']}), "
          f"false drops {audit['false_drops']}/{audit['clean']}; by kind {audit['by_kind']}")
    assert audit["planted"] >= 40 and audit["recall"] >= 0.95
    assert audit["false_drop_rate"] < 0.005
    assert {"exact", "re-cased", "inside longer text"} <= set(audit["by_kind"])
    assert all(v["recall"] >= 0.95 for v in audit["by_kind"].values()), audit["by_kind"]
    assert "dedup audit (demo ground truth): eval_caption recall" in out
    stats = json.loads((run_dir / "dedup" / "stats.json").read_text())
    assert stats["dropped"]["eval_caption"] >= audit["caught"]
    assert stats["caption_matches"]["captions"] > 100 and stats["caption_matches"]["mode"] == "drop"


def test_clip_score_bootstrap_separates_mismatched_captions(demo_filtered):
    run_dir, out = demo_filtered
    audit = json.loads((run_dir / "clip_score" / "audit.json").read_text())
    auc, mis = audit["roc_auc_clean_vs_mismatched"], audit["mismatched_caption"]
    print(f"clip_score: ROC AUC {auc:.3f}, mismatched removed {mis['caught']}/{mis['planted']}")
    # measured 0.898 on the demo (0.920 before #38 planted 40 evaluation captions and 34 clean
    # captions were found to hold one: 78 fewer training pairs); it moves by a few hundredths with
    # the pairs it learns from (0.870 at 400 steps), chance is 0.5
    assert auc >= 0.88
    assert mis["recall"] > 0.5                       # most of them, at keep_fraction 0.92
    assert re.search(r"ROC AUC of the score, clean vs mismatched captions 0\.(8[89]|9\d)\d", out)
    stats = json.loads((run_dir / "clip_score" / "stats.json").read_text())
    assert stats["scorer"]["kind"] == "bootstrap" and len(stats["scorer"]["sha256"]) == 64
    assert stats["scorer"]["trained_on"] >= 800 and stats["warning"] is None and "clip_score: warning" not in out
    assert stats["scorer"]["final_loss"] < stats["scorer"]["chance_loss"]
    assert sum(stats["histogram"]["counts"]) == stats["in"]
    assert stats["kept"] == -(-stats["in"] * 92 // 100)   # ceil(0.92 * in): one global cut
    cells = _status_row(run_dir, "clip_score")
    assert "clip_score=" in cells[-1]


def test_filter_reports_show_pictures_per_reason(demo_filtered):
    run_dir, _ = demo_filtered
    for stage in ("basic", "language", "clip_score"):
        page = (run_dir / stage / "report.html").read_text()
        stats = json.loads((run_dir / stage / "stats.json").read_text())
        for reason, n in stats["dropped"].items():
            assert f"{reason} ({min(n, 20)} of {n} shown)" in page
        assert page.count("<img") == page.count("data:image/jpeg;base64,")
        assert page.count("<img") == min(stats["kept"], 20) + sum(min(n, 20) for n in stats["dropped"].values())


def test_bootstrap_on_a_trusted_subset(demo_filtered, tmp_path):
    run_dir, _ = demo_filtered
    copy = tmp_path / "trusted"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("clip_score"))
    trusted = _kept(run_dir, "language")[::3] + ["not_a_key_of_this_run"]
    pq.write_table(pa.table({"key": trusted}), tmp_path / "trusted.parquet")
    proc = capline("run", str(ROOT / "configs" / "demo.yaml"), "--run-dir", str(copy), "--until", "clip_score",
                   "--set", f"stages.clip_score.bootstrap.trusted_keys={tmp_path / 'trusted.parquet'}",
                   "--set", "stages.clip_score.bootstrap.steps=40", *CACHE, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scorer = json.loads((copy / "clip_score" / "stats.json").read_text())["scorer"]
    assert scorer["trained_on"] == len(trusted) - 1 and scorer["trusted_keys"].endswith("trusted.parquet")
    assert f"training the bootstrap scorer on {len(trusted) - 1} trusted pairs" in proc.stdout


def test_openclipart_through_the_data_pipeline(tmp_path):
    from pathlib import Path

    from stages.source.openclipart import DEFAULT_ROOT

    if not Path(DEFAULT_ROOT).is_dir():
        pytest.fail("Debian's openclipart-svg is not installed; `make test` installs it (apt, as root)")
    run_dir = tmp_path / "oc"
    proc = capline("run", str(ROOT / "configs" / "openclipart.yaml"), "--run-dir", str(run_dir),
                   "--set", "source.limit=150", "--set", "stages.clip_score.bootstrap.steps=30", *CACHE, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    funnel = {}
    for stage in ("source", "ingest", "dedup", "basic", "language", "clip_score", "shard"):
        _status_row(run_dir, stage)
        funnel[stage] = json.loads((run_dir / stage / "stats.json").read_text())
    print({s: (f["in"], f["kept"], f["dropped"]) for s, f in funnel.items()})
    assert funnel["source"]["in"] == 150
    # real alt-text in other languages is found and named
    assert funnel["language"]["dropped"].get("language") and set(funnel["language"]["detected"]) - {"en"}
    assert funnel["clip_score"]["dropped"]["clip_score"] == funnel["clip_score"]["in"] - funnel["clip_score"]["kept"]
    assert funnel["shard"]["kept"] == funnel["clip_score"]["kept"]
    # captions in the final shards are the cleaned ones, from the drawings' own metadata
    captions = read_ledger(run_dir, "basic", ["caption", "verdict"]).to_pydict()
    assert all(c == c.strip() and "  " not in c for c, v in zip(captions["caption"], captions["verdict"]) if v == "kept")
    page = (run_dir / "language" / "report.html").read_text()
    assert "language (" in page and "data:image/jpeg;base64," in page


def test_run_report_renders_in_chromium(demo_filtered):
    """`capline run` wrote report.html; `capline report` writes it again; Chromium shows it cleanly."""
    from helpers import chromium_console

    run_dir, out = demo_filtered
    assert f"report: {run_dir}/report.html" in out
    # the report is drawn from what the stages stored (histograms, picks), never from a ledger: with
    # every Parquet file of the run hidden it is the same page
    hidden = [p.rename(p.with_name(p.name + ".hidden")) for p in run_dir.rglob("*.parquet")]
    try:
        assert len(hidden) > 10
        again = capline("report", str(run_dir), "--per-reason", "4")
    finally:
        for p in hidden:
            p.rename(p.with_name(p.name[:-len(".hidden")]))
    assert again.returncode == 0, again.stderr
    page = (run_dir / "report.html").read_text()
    for section in ("Funnel", "Scores and thresholds", "Samples kept and dropped", "Training", "Evaluation"):
        assert f"<h2>{section}</h2>" in page
    for reason in ("http_404=", "eval_duplicate=", "language=", "clip_score="):   # the funnel: reason=count
        assert reason in page
    assert "MLflow run" in page and "Training curves unavailable" not in page
    assert re.search(r"<td>demo_shape</td>", page) and all(f"<th>{k}-shot</th>" in page for k in (1, 5, 10, 25))
    for stage in ("ingest", "dedup", "basic", "language", "clip_score"):   # every stage report, linked
        assert f"href='{stage}/report.html'" in page and (run_dir / stage / "report.html").is_file(), stage
    assert "<th>% kept</th>" in page and "<h2>Audit against the demo's planted defects</h2>" in page
    assert "eval_near_copy" in page and "mismatched_caption" in page
    ingest = (run_dir / "ingest" / "report.html").read_text()
    assert "127.0.0.1:" in ingest and "http_404" in ingest and "timeout" in ingest
    dedup = (run_dir / "dedup" / "report.html").read_text()
    assert "dropped, then the sample kept in its place" in dedup and dedup.count("data:image/jpeg;base64,") >= 10
    capped = capline("report", str(run_dir), "--per-reason", "-1")
    assert capped.returncode == 2 and "--per-reason -1" in capped.stderr
    assert page.count("data:image/png;base64,") >= 5       # funnel, 3 score histograms, curves
    assert page.count("class='card kept'") >= 4 and page.count("class='card dropped'") >= 8
    shot = run_dir / "report.png"
    console = chromium_console(run_dir / "report.html", shot)
    assert console == [], console
    assert shot.stat().st_size > 50_000


def test_a_trained_run_prints_its_evaluation_once_training_progress_and_no_ray_noise(demo_filtered):
    _, out = demo_filtered
    assert out.count("evaluation of cappa/tiny:") == 1
    assert re.search(r"train: 30/30 steps, [\d.]+/s, ETA 0s, loss [\d.]+", out), out[-3000:]
    for noise in ("TrainController", "core_worker.cc", "Reporting training result", "RpcError", "INFO mlflow"):
        assert noise not in out, noise
