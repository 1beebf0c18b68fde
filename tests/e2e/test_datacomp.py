"""DataComp's baselines as configs that run as written: a synthetic pool in DataComp's metadata form
(uid, url, text, clip_b32/l14_similarity_score, face_bboxes, sha256), some of whose URLs are dead.
`capline init` writes the CLIP score (L/14 30%) recipe for it; configs/datacomp_clip_l14_30.yaml and
datacomp_basic_and_clip_l14_30.yaml keep exactly the uids an independent computation keeps: the top
30 % of the whole pool by L/14 score (dead URLs included, as DataComp counts them), of those that
reached the stage; uid and face_bboxes reach the shards as the list has them."""
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from helpers import ROOT, capline, synthetic_rows
from stages.base import read_ledger
from stages.source.demo_server import DemoServer
from stages.source.synthetic import SERVER_PLACEHOLDER

pytestmark = pytest.mark.slow


def _pool(tmp_path, server) -> dict:
    rows = synthetic_rows(tmp_path / "site", 60, 3)
    rng = np.random.default_rng(7)
    n = len(rows) + 20                                     # 20 rows whose images are gone
    l14 = np.round(rng.uniform(0.05, 0.45, n), 6)
    urls = [r["url"].replace(SERVER_PLACEHOLDER, server.base_url) for r in rows] + \
        [f"{server.base_url}/gone/{i}.jpg" for i in range(20)]
    texts = [r["caption"] for r in rows] + [f"a photo that is gone now number {i}" for i in range(20)]
    uids = [f"{i:032x}" for i in rng.permutation(10 ** 6)[:n]]
    pq.write_table(pa.table({
        "uid": uids, "url": urls, "text": texts,
        "original_width": [256] * n, "original_height": [256] * n,
        "clip_b32_similarity_score": np.round(l14 * 0.9, 6), "clip_l14_similarity_score": l14,
        "face_bboxes": [[[0.1, 0.2, 0.3, 0.4]] if i % 3 == 0 else [] for i in range(n)],
        "sha256": ["0" * 64] * n}), tmp_path / "pool.parquet")
    return dict(zip(uids, l14.tolist()))


def _top_of_pool(scores: dict, fraction: float) -> set:
    """DataComp's cut, computed here on its own: the top `fraction` of every row of the pool."""
    ranked = sorted(scores.values(), reverse=True)
    cut = ranked[math.ceil(fraction * len(ranked)) - 1]
    return {u for u, s in scores.items() if s >= cut}


def test_datacomps_clip_score_baselines_keep_the_top_of_the_pool(tmp_path):
    with DemoServer(tmp_path / "site" / "www") as server:
        scores = _pool(tmp_path, server)
        made = capline("init", str(tmp_path / "pool.parquet"), "--output", str(tmp_path / "init.yaml"))
        assert made.returncode == 0, made.stdout + made.stderr
        written = yaml.safe_load((tmp_path / "init.yaml").read_text())
        assert written["source"]["key_col"] == "uid"
        assert written["stages"]["clip_score"] == {"scorer": "column", "column": "clip_l14_similarity_score",
                                                   "threshold": None, "keep_fraction": 0.3, "keep_fraction_of": "pool"}
        run = tmp_path / "run"
        sets = ["--set", f"source.path={tmp_path / 'pool.parquet'}", "--set", f"stages.ingest.allow_hosts=['{server.netloc}']",
                "--set", "stages.ingest.image_size=32", "--set", "stages.ingest.retries=0", "--set", "stages.ingest.timeout=3",
                "--set", "stages.tokenizer.vocab_size=300", "--set", "stages.shard.samples_per_shard=20",
                "--set", "ray.object_store_memory_mb=256"]
        for config, extra in (("datacomp_clip_l14_30", []),
                              ("datacomp_basic_and_clip_l14_30", ["--set", "stages.basic.min_image_side=16"])):
            out = capline("run", str(ROOT / "configs" / f"{config}.yaml"), "--run-dir", str(run), *sets, *extra,
                          "--until", "shard", timeout=900)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            assert "of the pool's 80 rows by clip_l14_similarity_score" in out.stdout
            ledger = read_ledger(run, "clip_score", ["key", "verdict"]).to_pylist()
            reached = {r["key"] for r in ledger}
            kept = {r["key"] for r in ledger if r["verdict"] == "kept"}
            assert len(reached) < 80 and kept == _top_of_pool(scores, 0.3) & reached, config
            assert 0 < len(kept) < len(reached)
            # what the stage's own keep_fraction (of what reached it) would keep is another set
            assert kept != _top_of_pool({u: scores[u] for u in reached}, 0.3)
    # the shards carry the list's uid and its face boxes as JSON values, not strings
    from infra.tars import tar_samples

    samples = [json.loads(parts["json"]) for tar in sorted((run / "shard" / "shards").glob("*.tar"))
               for _, parts in tar_samples(tar)]
    assert {s["uid"] for s in samples} == kept
    assert any(s["face_bboxes"] == [[0.1, 0.2, 0.3, 0.4]] for s in samples)
    assert all(isinstance(s["face_bboxes"], list) for s in samples)
    assert all(s["source_sha256"] == "0" * 64 and s["sha256"] != "0" * 64 for s in samples)
