"""End to end through the real CLI: the demo source, a local Ray cluster, img2dataset on loopback.

Includes the kill test: SIGKILL to the driver in the middle of ingest, the same command again, and
the final shards hold exactly the samples (same keys, same image bytes) of an uninterrupted run.
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import pyarrow.parquet as pq
import pytest

from stages.base import read_ledger
import webdataset as wds

from helpers import ROOT, capline, kill_driver

pytestmark = pytest.mark.slow

ARGS = ["--set", "source.num_samples=600", "--set", "source.eval_size=30", "--set", "source.slow_seconds=4",
        "--set", "stages.ingest.timeout=2", "--set", "stages.ingest.samples_per_shard=40",
        "--set", "stages.shard.samples_per_shard=130", "--set", "train.steps=0",
        "--set", "stages.clip_score.bootstrap.steps=50",
        "--set", f"stages.dedup.cache_dir={tempfile.mkdtemp(prefix='capline-eval-index-')}"]


def _content(run_dir):
    shards = sorted(str(p) for p in (run_dir / "ingest").glob("parts/*/shards/*.tar"))
    return {json.loads(s["json"])["uid"]: hashlib.sha256(s["jpg"]).hexdigest()
            for s in wds.WebDataset(shards, shardshuffle=False)}


def _verdicts(run_dir):
    t = read_ledger(run_dir, "ingest").to_pylist()
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
    from pipeline.runner import stage_names

    assert set(manifest["stages"]) == set(stage_names())
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
    ingest = run_dir / "ingest"
    deadline = time.time() + 240
    while time.time() < deadline:
        done = len(list(ingest.glob("parts/*/shards/*_stats.json")))
        if done >= 3:
            break
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.2)
    else:
        pytest.fail("ingest never got going")
    kill_driver(proc)
    assert not (run_dir / "ingest" / "_SUCCESS").exists()
    assert len(list(ingest.glob("parts/*/shards/*_stats.json"))) < 15, "killed too late to test anything"

    # a second kill, at a random later point of the resumed run
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    time.sleep(float(__import__("random").Random(7).uniform(12, 20)))
    kill_driver(proc)

    again = capline("run", "--run-dir", str(run_dir), *ARGS)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert _content(run_dir) == _content(ref_dir)
    assert _verdicts(run_dir) == _verdicts(ref_dir)
    verdict = capline("verify", str(ref_dir), str(run_dir))
    assert verdict.returncode == 0, verdict.stdout
    assert "byte-identical" in verdict.stdout


def test_final_shards_read_back_once_per_epoch(reference_run):
    """With the plain WebDataset reader, and with a loader written the way open_clip's is."""
    import torch

    run_dir, _ = reference_run
    sizes = json.loads((run_dir / "shard" / "sizes.json").read_text())
    total = sum(sizes.values())
    names = sorted(sizes)
    assert len(names) == 4
    plain = [s["__key__"] for s in wds.WebDataset([str(run_dir / "shard" / "shards" / n) for n in names],
                                                  shardshuffle=False)]
    assert len(plain) == len(set(plain)) == total
    brace = str(run_dir / "shard" / "shards" / f"{{{names[0][:-4]}..{names[-1][:-4]}}}.tar")
    seen = []
    for rank in range(2):                       # two "nodes", each with two loader workers
        os.environ.update(RANK=str(rank), WORLD_SIZE="2")
        try:
            ds = wds.DataPipeline(
                wds.SimpleShardList(brace), wds.split_by_node, wds.split_by_worker, wds.tarfile_to_samples(),
                wds.to_tuple("__key__", "txt"))
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
            seen += [k for k, _ in loader]
        finally:
            del os.environ["RANK"], os.environ["WORLD_SIZE"]
    assert sorted(seen) == sorted(plain)


def test_rebuild_names_died_and_changed_urls(reference_run, tmp_path):
    import shutil

    from PIL import Image

    ref_dir, _ = reference_run
    old = tmp_path / "old"
    shutil.copytree(ref_dir, old)
    kept = [k for k, (v, _) in _verdicts(old).items() if v == "kept"]
    truth = {r["key"]: r["defect"] for r in pq.read_table(old / "source" / "_ground_truth.parquet").to_pylist()}
    clean = sorted(k for k in kept if truth[k] == "clean")
    removed, changed = clean[:2], clean[2:5]
    www = old / "source" / "www" / "img"
    for k in removed:
        (www / f"{k}.jpg").unlink()
    for k in changed:
        Image.new("RGB", (96, 96), (10, 200, 30)).save(www / f"{k}.jpg", "JPEG")
    out = capline("rebuild", str(old / "manifest.json"), "--run-dir", str(tmp_path / "new"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "new" / "drift.json").read_text())
    assert report["died"] == sorted(removed)
    assert report["changed"] == sorted(changed)
    assert "2 URLs died, 3 changed content" in out.stdout
