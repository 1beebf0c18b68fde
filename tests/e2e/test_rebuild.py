"""`capline rebuild` of a data build (a URL list run with `--until shard`, as the README builds
data): it stops where the original stopped (no model trained, nothing evaluated), says the drift as
soon as the downloads are done, and finds the shards byte-identical when nothing on the site changed."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from helpers import bucket_keys, capline, moto_s3, synthetic_rows
from stages.demo_server import DemoServer
from stages.synthetic import SERVER_PLACEHOLDER

pytestmark = pytest.mark.slow


def _build_config(tmp_path, urls, server) -> str:
    config = {"name": "build", "source": {"kind": "urls", "path": str(urls), "url_col": "url", "caption_col": "caption"},
              "ray": {"object_store_memory_mb": 256}, "track_data": False,
              "stages": {"ingest": {"allow_hosts": [server.netloc], "samples_per_shard": 30},
                         "dedup": {"eval_sets": []}, "basic": {"min_image_side": 16},
                         "clip_score": {"bootstrap": {"steps": 5}}, "tokenizer": {"vocab_size": 300},
                         "shard": {"samples_per_shard": 50}}}
    (tmp_path / "build.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "build.yaml")


def test_a_data_build_in_a_bucket_is_rebuilt_into_the_bucket(tmp_path):
    """The same with the original and the rebuild in a bucket (moto's server on loopback): the
    manifest is read from the bucket, the source copied object by object, the rebuild written there."""
    rows = synthetic_rows(tmp_path / "site", 40, 5)
    urls = tmp_path / "urls"
    urls.mkdir()
    gen = moto_s3("capline-rebuild")
    env, client = next(gen)
    env = {**env, "CAPLINE_CACHE": str(tmp_path / "cache")}
    try:
        with DemoServer(tmp_path / "site" / "www") as server:
            pq.write_table(pa.table({"url": [r["url"].replace(SERVER_PLACEHOLDER, server.base_url) for r in rows],
                                     "caption": [r["caption"] for r in rows]}), urls / "a.parquet")
            config = _build_config(tmp_path, urls, server)
            made = capline("run", config, "--run-dir", "s3://capline-rebuild/run", "--until", "shard", env=env, timeout=900)
            assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
            out = capline("rebuild", "s3://capline-rebuild/run", "--run-dir", "s3://capline-rebuild/again", env=env,
                          timeout=900)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-3000:]
        assert "drift: 0 URLs died, 0 changed content, 0 came back" in out.stdout
        assert "shards: byte-identical to the original (by the sha256 each run recorded)" in out.stdout
        keys = bucket_keys(client, "capline-rebuild", "again/")
        assert "again/drift.json" in keys and "again/manifest.json" in keys and "again/shard/_SUCCESS" in keys
        assert not any(k.startswith(("again/train/", "again/eval/")) for k in keys)
    finally:
        try:
            next(gen)
        except StopIteration:
            pass


def test_a_data_build_is_rebuilt_to_its_shards_with_its_drift_said_first(tmp_path):
    rows = synthetic_rows(tmp_path / "site", 60, 3)
    urls, run, again = tmp_path / "urls", tmp_path / "run", tmp_path / "again"
    urls.mkdir()
    with DemoServer(tmp_path / "site" / "www") as server:
        pq.write_table(pa.table({"url": [r["url"].replace(SERVER_PLACEHOLDER, server.base_url) for r in rows],
                                 "caption": [r["caption"] for r in rows]}), urls / "a.parquet")
        made = capline("run", _build_config(tmp_path, urls, server), "--run-dir", str(run), "--until", "shard",
                       timeout=900)
        assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
        out = capline("rebuild", str(run), "--run-dir", str(again), timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "up to shard" in text
    assert not (again / "train").exists() and not (again / "eval").exists()
    assert "drift: 0 URLs died, 0 changed content, 0 came back" in out.stdout
    # the drift was said before the stages after ingest ran
    assert out.stdout.index("drift: ") < out.stdout.index("dedup: running")
    assert "shards: byte-identical to the original" in out.stdout
    assert json.loads((again / "drift.json").read_text())["counts"] == {"died": 0, "changed": 0, "revived": 0}
    bad = capline("rebuild", str(run), "--run-dir", str(tmp_path / "x"), "--until", "shrad")
    assert bad.returncode != 0 and "--until shrad: no such stage" in bad.stdout + bad.stderr
