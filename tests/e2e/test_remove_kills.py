"""A `capline remove` SIGKILLed at each of its write points (CAPLINE_KILLPOINT), then whatever the user
runs next: `verify` names the half-done removal, `remove --finish` or the same command again
finishes it, any other remove, recheck or run refuses until then (the journal is a file in the run
folder: what it deletes runs only on the user's own command), and the line ends as an undisturbed removal leaves it: the sample out of every
shard, its URL, sha256 and descriptor in removed.parquet, the removal listed once, the line verifies,
no other published sample lost, and the sample does not come back in the next append."""
import json
import os
import subprocess
import sys
import time

import psutil
import pyarrow.parquet as pq
import pytest

from helpers import ROOT, capline, synthetic_rows
from stages.source.demo_server import DemoServer
from test_remove import _config, _list, _samples

pytestmark = pytest.mark.slow


def _killed(*args: str, at: str) -> str:
    """Run capline until it kills itself at `at`; reap the Ray processes it leaves (they outlive it)."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "CAPLINE_KILLPOINT": at})
    tree: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            tree.update({p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.2)
    out = proc.communicate(timeout=60)[0]
    for p in tree.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(tree.values()), timeout=20)
    assert proc.returncode == -9 and f"killpoint: {at}" in out, out[-3000:]
    return out


def _ok(out) -> str:
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    return text


def test_a_removal_killed_at_any_write_point_is_finished_by_the_next_command(tmp_path):
    rows = synthetic_rows(tmp_path / "site", 40, 5)
    urls, run = tmp_path / "urls", tmp_path / "run"
    urls.mkdir()
    with DemoServer(tmp_path / "site" / "www") as server:
        config = _config(tmp_path, urls, server)
        _list(urls / "a.parquet", rows[:36], server)
        _ok(capline("run", config, "--run-dir", str(run), "--until", "shard", timeout=900))
        before = _samples(run)
        by_shard = {}
        for key, (shard, _) in sorted(before.items()):
            by_shard.setdefault(shard, key)
        assert len(by_shard) >= 4
        victims = list(by_shard.values())[:4]
        meta = {k: json.loads(before[k][1]["json"]) for k in victims}
        lists = []
        for i, k in enumerate(victims):
            lists.append(tmp_path / f"takedown{i}.txt")
            lists[-1].write_text(f"{meta[k]['url']}\n")

        def remove(i, *extra):
            return ["remove", str(run), "--list", str(lists[i]), "--reason", f"takedown {i}", *extra]

        originals = {p.name: p.read_bytes() for p in (run / "shard" / "shards").glob("*.tar")}

        def in_force(n: int) -> None:
            """Removals 1..n done as if never interrupted."""
            assert "half done" not in _ok(capline("verify", str(run)))
            now = _samples(run)
            assert set(now) == set(before) - set(victims[:n])      # nothing else lost
            line = json.loads((run / "shard" / "line" / "line.json").read_text())
            assert [r["removal"] for r in line["removals"]] == list(range(1, n + 1))
            assert [r["keys"] for r in line["removals"]] == [[k] for k in victims[:n]]
            removed = pq.read_table(run / "shard" / "line" / "removed.parquet").to_pylist()
            samples = [r for r in removed if r["kind"] == "sample"]
            assert [(r["key"], r["url"], r["sha256"]) for r in samples] == \
                [(k, meta[k]["url"], meta[k]["sha256"]) for k in victims[:n]]
            assert all(r["vec"] for r in samples)
            for r in line["removals"]:   # the old versions kept, byte for byte
                (name,) = r["shards"]
                assert (run / "shard" / "line" / "versions" / str(r["removal"]) / name).read_bytes() == originals[name]

        # 1. killed once decided, before any shard changed: `remove --finish`
        _killed(*remove(0), at="remove: journalled")
        told = capline("verify", str(run))
        assert told.returncode != 0 and "removal 1" in told.stdout + told.stderr and "--finish" in told.stdout + told.stderr
        assert "removal 1" in _ok(capline("remove", str(run), "--finish"))
        in_force(1)
        assert "nothing to finish" in _ok(capline("remove", str(run), "--finish"))

        # 2. killed with its shard rewritten, the line not told: the same command again
        _killed(*remove(1), at="remove: shards rewritten")
        again = _ok(capline(*remove(1)))
        assert "removal 2: 1 samples removed" in again
        in_force(2)

        # 3. killed with the published records changed: an append is refused until it is finished
        _killed(*remove(2), at="remove: records unpublished")
        refused = capline("run", config, "--run-dir", str(run), "--until", "shard", timeout=900)
        assert refused.returncode != 0 and "--finish" in refused.stdout + refused.stderr, refused.stdout[-2000:]
        _ok(capline("remove", str(run), "--finish"))
        in_force(3)

        # 4. killed with the line written, its lists not: another removal is refused until it is finished
        _killed(*remove(3), at="remove: line written")
        (tmp_path / "none.txt").write_text("key u0000000000000000\n")
        other = ("remove", str(run), "--list", str(tmp_path / "none.txt"), "--reason", "nothing")
        refused = capline(*other)
        assert refused.returncode != 0 and "--finish" in refused.stderr, refused.stdout[-2000:] + refused.stderr
        assert "1 sample(s) from 1 shard(s)" in _ok(capline("remove", str(run), "--finish"))
        _ok(capline(*other))
        line = json.loads((run / "shard" / "line" / "line.json").read_text())
        assert [r["removal"] for r in line["removals"]] == [1, 2, 3, 4, 5] and line["removals"][4]["removed"] == 0
        assert set(_samples(run)) == set(before) - set(victims)
        assert "half done" not in _ok(capline("verify", str(run)))

        # every removal stays in force: the next append lists the removed URLs again, none comes back;
        # it is killed once its new shards are written, then once its records are, then run to the end
        _list(urls / "b.parquet", rows[36:] + [{"url": r["url"], "caption": "again " + r["caption"]} for r in rows[:36]],
              server)
        append = ("run", config, "--run-dir", str(run), "--until", "shard")
        for at in ("shard: shards written", "shard: records published"):
            _killed(*append, at=at)
            assert set(_samples(run)) >= set(before) - set(victims)     # nothing published lost meanwhile
        _ok(capline(*append, timeout=900))
        final = _samples(run)
        urls_now = {k: json.loads(p["json"])["url"] for k, (_, p) in final.items()}
        assert not set(urls_now.values()) & {meta[k]["url"] for k in victims}
        assert set(before) - set(victims) < set(final)
        assert len(final) == len(set(urls_now.values()))   # every URL once: 36 - 4 first, then the 4 new ones
        assert len(final) == 36 - 4 + 4
        _ok(capline("verify", str(run)))

        # a recheck killed inside its removal: the next recheck finishes it
        key = sorted(set(final) - set(before))[0]
        (tmp_path / "site" / "www" / "robots.txt").write_text(
            f"User-agent: *\nDisallow: {urls_now[key].split(server.base_url, 1)[1]}\n")
        _killed("recheck", str(run), at="remove: shards rewritten")
        refused = capline("recheck", str(run), timeout=900)
        assert refused.returncode != 0 and "--finish" in refused.stderr, refused.stdout[-2000:] + refused.stderr
        _ok(capline("remove", str(run), "--finish"))
        line = json.loads((run / "shard" / "line" / "line.json").read_text())
        assert line["removals"][-1]["keys"] == [key] and "recheck 1" in line["removals"][-1]["reason"]
        assert set(_samples(run)) == set(final) - {key}
        assert "half done" not in _ok(capline("verify", str(run)))
