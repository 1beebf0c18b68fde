"""Partitions never move: the same URL files on a Ray declaring 4 and then 64 CPUs make the same
partitions (every stage finds its input unchanged), and 3 % more URLs in a dataset line that goes on
leave every old partition reused by every stage. Through the real CLI: each run starts its own Ray."""
import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from helpers import capline, synthetic_rows
from stages.source.demo_server import DemoServer
from stages.source.synthetic import SERVER_PLACEHOLDER

pytestmark = pytest.mark.slow

STAGES = ("ingest", "dedup", "basic", "language", "clip_score", "tokenizer", "shard")


def _list(path, rows, base):
    pq.write_table(pa.table({"url": [r["url"].replace(SERVER_PLACEHOLDER, base) for r in rows],
                             "caption": [r["caption"] for r in rows],
                             "similarity": [0.3 + (i % 7) / 100 for i in range(len(rows))]}), path)


def _shards(run) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((run / "shard" / "shards").glob("*.tar"))}


def _parts(run, stage) -> dict[str, str]:
    return {p["part"]: p["sha256"] for p in json.loads((run / stage / "parts.json").read_text())}


def test_another_cluster_and_three_percent_more_reuse_every_partition(tmp_path):
    rows = synthetic_rows(tmp_path / "site", 206, 11)
    urls, run = tmp_path / "urls", tmp_path / "run"
    urls.mkdir()
    with DemoServer(tmp_path / "site" / "www") as server:
        config = {"name": "stay", "source": {"kind": "urls", "path": str(urls), "url_col": "url", "caption_col": "caption"},
                  "ray": {"object_store_memory_mb": 256},
                  "track_data": False, "train": {"steps": 0}, "dataset_line": True,
                  "stages": {"ingest": {"allow_hosts": [server.netloc], "samples_per_shard": 20, "compact_rows": 40},
                             "dedup": {"eval_sets": []}, "basic": {"min_image_side": 16},
                             "clip_score": {"scorer": "column", "column": "similarity", "threshold": 0.3,
                                            "keep_fraction": None},
                             "tokenizer": {"vocab_size": 300},
                             "shard": {"samples_per_shard": 50}}}
        (tmp_path / "stay.yaml").write_text(yaml.safe_dump(config))

        def run_on(cpus: int) -> str:
            proc = capline("run", str(tmp_path / "stay.yaml"), "--run-dir", str(run), "--until", "shard",
                           "--set", f"ray.num_cpus={cpus}", timeout=900)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            return proc.stdout + proc.stderr

        _list(urls / "a.parquet", rows[:200], server.base_url)
        first = run_on(4)
        assert "ray: starting a local cluster (4 CPUs" in first
        shards, parts = _shards(run), {s: _parts(run, s) for s in ("ingest", "dedup", "basic")}
        assert len(parts["ingest"]) == 5            # 10 shards of 20, two to a partition: from the config alone

        again = run_on(64)                          # the same files on a cluster 16 times the size
        assert "ray: starting a local cluster (64 CPUs" in again
        for stage in STAGES:
            assert f"{stage}: done before with the same input, skipped" in again, (stage, again[-3000:])
        assert _shards(run) == shards

        _list(urls / "b.parquet", rows[200:], server.base_url)     # 6 more URLs: 3 %
        grown = run_on(64)
    assert "ingest: 10 shards downloaded before, reused; 1 to download" in grown, grown[-3000:]
    assert "dedup: 5 partitions described before with the same input, reused; 1 to describe" in grown, grown[-3000:]
    for stage in ("basic", "language"):
        assert f"{stage}: 5 partitions unchanged since an earlier run, reused; 1 to compute" in grown, grown[-3000:]
    assert "clip_score: 5 partitions" in grown and "reused; 1 to score" in grown, grown[-3000:]
    for stage in ("ingest", "dedup", "basic", "language", "clip_score"):
        # the key index kept from the first run; the one ledger the run added handed over by its task, not read
        # and only its keys written: a segment of its own beside the first run's (the key index merges
        # segments of like size, never the stage's first one for a 3 % append)
        stats = json.loads((run / stage / "stats.json").read_text())
        assert {k: v for k, v in stats["key_index"].items() if k != "rows_written"} == {
            "ledgers": 6, "ledgers_read": 0, "ledgers_handed": 1, "segments": 2}, stage
        assert 0 < stats["key_index"]["rows_written"] <= 0.1 * stats["in"], (stage, stats["key_index"])
    for stage in ("ingest", "dedup", "basic"):
        now = _parts(run, stage)
        assert {p: now[p] for p in parts[stage]} == parts[stage]        # every old partition, byte for byte
        assert len(now) == len(parts[stage]) + 1
    after = _shards(run)
    assert {k: after[k] for k in shards} == shards and len(after) > len(shards)   # the line went on
