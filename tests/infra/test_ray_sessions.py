"""Unit: local clusters' session folders are pruned (253 of them, 378 MB, had piled up here): those
whose starting process is gone, but the newest few."""
import os
import subprocess
import sys

from infra.ray_runtime import prune_sessions


def test_dead_clusters_sessions_go_but_the_newest_and_live_ones_stay(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = [f"session_2026-12-0{d}_10-00-00_123456_{dead.pid}" for d in range(1, 6)]
    live = f"session_2026-12-01_09-00-00_000001_{os.getpid()}"
    for n in [*names, live, "session_latest_not_a_session", "prom_metrics_service_discovery.json"]:
        (tmp_path / n).mkdir()
    (tmp_path / names[0] / "logs").mkdir()
    os.symlink(tmp_path / names[-1], tmp_path / "session_latest")
    gone = prune_sessions(str(tmp_path), keep=2)
    assert gone == [str(tmp_path / n) for n in names[:3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*names[3:], live, "session_latest", "session_latest_not_a_session", "prom_metrics_service_discovery.json"])
    assert prune_sessions(str(tmp_path / "absent")) == []
