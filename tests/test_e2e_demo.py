"""End to end through the real CLI: the demo source, a local Ray cluster, img2dataset on loopback.

Includes the kill test: SIGKILL to the driver in the middle of ingest, the same command again, and
the final shards hold exactly the samples (same keys, same image bytes) of an uninterrupted run.
"""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from tests.conftest import ROOT, capline

pytestmark = pytest.mark.slow

ARGS = ["--set", "source.num_samples=600", "--set", "source.eval_size=30", "--set", "source.slow_seconds=4",
        "--set", "stages.ingest.timeout=2", "--set", "stages.ingest.samples_per_shard=40"]


def _content(run_dir):
    shards = sorted(str(p) for p in (run_dir / "ingest" / "shards").glob("*.tar"))
    return {json.loads(s["json"])["uid"]: hashlib.sha256(s["jpg"]).hexdigest()
            for s in wds.WebDataset(shards, shardshuffle=False)}


def _verdicts(run_dir):
    t = pq.read_table(run_dir / "ingest" / "ledger.parquet").to_pylist()
    return {r["key"]: (r["verdict"], r["reason"]) for r in t}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    proc = capline("run", "--run-dir", str(run_dir), *ARGS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc


def test_demo_run_reports_its_funnel(reference_run):
    run_dir, proc = reference_run
    assert "Traceback" not in proc.stderr
    stats = json.loads((run_dir / "ingest" / "stats.json").read_text())
    assert stats["in"] == stats["kept"] + sum(stats["dropped"].values()) == 600
    for reason in ("http_404", "http_500", "timeout", "undecodable_image", "truncated_image",
                   "not_an_image", "image_too_large", "too_many_bytes", "empty_caption"):
        assert stats["dropped"].get(reason, 0) > 0, (reason, stats)
    status = capline("status", str(run_dir))
    assert status.returncode == 0
    row = next(ln for ln in status.stdout.splitlines() if ln.startswith("ingest"))
    cells = row.split()
    assert cells[1] == "done" and int(cells[2]) == int(cells[3]) + int(cells[4]) == 600
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert set(manifest["stages"]) == {"source", "ingest"}
    assert manifest["config"]["source"]["num_samples"] == 600
    assert manifest["packages"]["img2dataset"] == "1.47.0"
    assert (run_dir / "config.yaml").is_file()


def test_explain_follows_one_sample(reference_run):
    run_dir, _ = reference_run
    truth = pq.read_table(run_dir / "source" / "_ground_truth.parquet").to_pylist()
    key = next(r["key"] for r in truth if r["defect"] == "http_404")
    out = capline("explain", str(run_dir), key)
    assert out.returncode == 0
    assert "source     kept" in out.stdout and "ingest     dropped (http_404)" in out.stdout


def test_rerun_of_a_finished_run_skips_everything(reference_run):
    run_dir, _ = reference_run
    before = (run_dir / "ingest" / "_SUCCESS").read_text()
    proc = capline("run", "--run-dir", str(run_dir), *ARGS)
    assert proc.returncode == 0
    assert "source: done before with the same input, skipped" in proc.stdout
    assert "ingest: done before with the same input, skipped" in proc.stdout
    assert (run_dir / "ingest" / "_SUCCESS").read_text() == before


def test_kill_mid_ingest_then_resume_gives_the_same_shards(reference_run, tmp_path):
    ref_dir, _ = reference_run
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "--run-dir", str(run_dir), *ARGS]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ))
    shards = run_dir / "ingest" / "shards"
    deadline = time.time() + 240
    tree = []
    while time.time() < deadline:
        done = len(list(shards.glob("*_stats.json"))) if shards.exists() else 0
        if done >= 3:
            break
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.2)
    else:
        pytest.fail("ingest never got going")
    tree = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # A SIGKILLed driver leaves Ray's agents behind (they are Ray's, not capline's): reap them.
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=20)
    assert not (run_dir / "ingest" / "_SUCCESS").exists()
    assert len(list(shards.glob("*_stats.json"))) < 15, "killed too late to test anything"

    again = capline("run", "--run-dir", str(run_dir), *ARGS)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming" in again.stdout
    assert _content(run_dir) == _content(ref_dir)
    assert _verdicts(run_dir) == _verdicts(ref_dir)
