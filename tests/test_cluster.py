"""A real two-node Ray cluster on loopback: `ray start --head`, a second node with `ray start
--address` (its own resources and process tree), `capline run --address` on it, work seen on both
nodes, and both stopped by pid afterwards."""
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from helpers import capline

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_pids() -> set[int]:
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ray" in cmd and ("raylet" in cmd or "gcs_server" in cmd or "ray/" in cmd or "ray::" in cmd):
            out.add(p.pid)
    return out


def _stop(pids: set[int]) -> None:
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture
def two_node_cluster():
    port, dash = _free_port(), _free_port()
    before = _ray_pids()
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--object-store-memory", str(200 * 2**20),
              "--disable-usage-stats"]
    # the nodes get the guard but none of capline's quiet switches, as a user's shell would:
    # capline must pass them to its workers itself
    from pipeline.offline import QUIET_ENV

    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}
    started = set()
    try:
        head = subprocess.run([RAY, "start", "--head", "--port", str(port), "--dashboard-host", "127.0.0.1",
                               "--dashboard-port", str(dash), "--resources", '{"head": 1}', *common],
                              capture_output=True, text=True, timeout=120, env=env)
        assert head.returncode == 0, head.stdout + head.stderr
        second = subprocess.run([RAY, "start", "--address", f"127.0.0.1:{port}", "--resources", '{"second": 1}',
                                 *common], capture_output=True, text=True, timeout=120, env=env)
        assert second.returncode == 0, second.stdout + second.stderr
        started = _ray_pids() - before
        yield f"127.0.0.1:{port}"
    finally:
        _stop(started or (_ray_pids() - before))
        # `ray start --head` records itself for plain ray.init() calls to join; it is gone now
        current = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()
        assert not (_ray_pids() - before) & started, "the cluster's processes outlived the stop"


def test_demo_pipeline_and_training_on_two_nodes(two_node_cluster, tmp_path):
    run_dir = tmp_path / "run"
    proc = capline("run", "--address", two_node_cluster, "--run-dir", str(run_dir),
                   "--set", "source.num_samples=300", "--set", "source.eval_size=30",
                   "--set", "stages.ingest.samples_per_shard=30", "--set", "stages.shard.samples_per_shard=100",
                   "--set", "stages.clip_score.bootstrap.steps=30", "--set", "stages.clip_score.bootstrap.cpus=1",
                   "--set", "stages.dedup.cpus_per_worker=0.5", "--set", "stages.clip_score.cpus_per_worker=0.5",
                   "--set", f"stages.dedup.cache_dir={tempfile.mkdtemp(prefix='capline-eval-index-')}",
                   "--set", "train.steps=20", "--set", "train.num_workers=2", "--set", "train.checkpoint_every=20",
                   "--set", "train.sample_every=20", "--until", "train", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"ray: joining the cluster at {two_node_cluster}" in proc.stdout
    ingest = json.loads((run_dir / "ingest" / "stats.json").read_text())
    train = json.loads((run_dir / "train" / "stats.json").read_text())
    print("ingest nodes", ingest["nodes"], "train nodes", train["nodes"])
    assert len(ingest["nodes"]) == 2, ingest["nodes"]          # download tasks ran on both nodes
    assert len(train["nodes"]) == 2, train["nodes"]            # one training worker on each
    assert set(train["nodes"]) == set(ingest["nodes"])
    assert train["step"] == 20
