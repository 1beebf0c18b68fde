"""Scheduled runs: `--incremental` against the last completed run, and the run-folder lock."""
import json
import os
import subprocess
import sys
import time

import pytest

from helpers import ROOT, capline, kill_driver
from pipeline.schedule import plan


def _manifest(run_dir, files, completed=True):
    run_dir.mkdir(parents=True, exist_ok=True)
    data = {"inputs": {"source": {"kind": "urls", "files": files}}}
    if completed:
        data["completed"] = {"at": "2026-11-30T00:00:00Z", "inputs": {"source": {"kind": "urls", "files": files}}}
    (run_dir / "manifest.json").write_text(json.dumps(data))


def test_plan_names_what_is_new(tmp_path):
    src = lambda files: {"source": {"kind": "urls", "files": files}}  # noqa: E731
    assert plan(src({"a.csv": "1"}), tmp_path / "none")[0] is True
    _manifest(tmp_path / "r", {"a.csv": "1"})
    needed, why = plan(src({"a.csv": "1"}), tmp_path / "r")
    assert not needed and "no new partitions" in why and "nothing to do" in why
    needed, why = plan(src({"a.csv": "1", "b.csv": "2"}), tmp_path / "r")
    assert needed and "1 new partition(s): b.csv" in why
    needed, why = plan(src({"a.csv": "9"}), tmp_path / "r")
    assert needed and "1 changed since the last run: a.csv" in why
    _manifest(tmp_path / "k", {"a.csv": "1"}, completed=False)
    assert plan(src({"a.csv": "1"}), tmp_path / "k") == (True, "incremental: the last run did not complete; resuming it")


@pytest.mark.slow
def test_scheduled_incremental_runs_and_a_concurrent_one(tmp_path):
    from stages.source.demo_server import DemoServer
    from stages.source.synthetic import SERVER_PLACEHOLDER
    from helpers import synthetic_rows

    rows = synthetic_rows(tmp_path / "site", 300, 3)
    urls = tmp_path / "urls"
    urls.mkdir()
    run_dir = tmp_path / "run"

    with DemoServer(tmp_path / "site" / "www") as server:
        def part(name, chunk):
            lines = ["url,caption"] + [f"{r['url'].replace(SERVER_PLACEHOLDER, server.base_url)},\"{r['caption']}\""
                                       for r in chunk]
            (urls / name).write_text("\n".join(lines) + "\n")

        args = ["run", "--run-dir", str(run_dir), "--set", "source.kind=urls", "--set", f"source.path={urls}",
                "--set", f"stages.ingest.allow_hosts=['{server.netloc}']", "--set", "stages.ingest.samples_per_shard=50",
                "--set", "stages.tokenizer.vocab_size=400", "--set", "stages.dedup.eval_sets=[]",
                "--set", "stages.basic.min_image_side=16", "--set", "stages.language.min_confidence=0.1",
                "--set", "stages.clip_score.bootstrap.steps=20", "--set", "stages.shard.samples_per_shard=80",
                "--set", "train.steps=0", "--incremental"]
        part("0001.csv", rows[:100])
        first = capline(*args)
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        assert "incremental: no earlier run in this folder" in first.stdout

        again = capline(*args)
        assert again.returncode == 0, again.stderr
        assert "no new partitions since the run completed at" in again.stdout and "nothing to do" in again.stdout
        assert "ray:" not in again.stdout          # nothing started

        part("0002.csv", rows[100:200])
        second = capline(*args)
        assert second.returncode == 0, second.stderr[-2000:]
        assert "incremental: 1 new partition(s): 0002.csv" in second.stdout
        assert "ingest: 2 shards downloaded before, reused; 2 to download" in second.stdout   # 0001.csv's two
        assert json.loads((run_dir / "ingest" / "stats.json").read_text())["in"] == 200

        # a scheduled run while another is still going: refused, naming the holder
        part("0003.csv", rows[200:])
        holder = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
        deadline = time.time() + 60
        while not (run_dir / ".capline.lock").exists() and time.time() < deadline:
            time.sleep(0.1)
        refused = capline(*args)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"is in use by another capline run (pid {holder.pid} on" in refused.stderr
        # the holder dies without releasing the lock: the next run takes it over and finishes the job
        kill_driver(holder)
        assert (run_dir / ".capline.lock").exists()
        third = capline(*args)
        assert third.returncode == 0, third.stderr[-2000:]
        assert f"lock: taking over a stale lock of pid {holder.pid}" in third.stdout
        assert json.loads((run_dir / "ingest" / "stats.json").read_text())["in"] == 300
        assert not (run_dir / ".capline.lock").exists()
