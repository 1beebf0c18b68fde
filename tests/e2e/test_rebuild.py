"""`capline rebuild` of a data build (a URL list run with `--until shard`, as the README builds
data): it stops where the original stopped (no model trained, nothing evaluated), says the drift as
soon as the downloads are done, and finds the shards byte-identical when nothing on the site changed."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from helpers import bucket_keys, capline, moto_s3, synthetic_rows
from stages.source.demo_server import DemoServer
from stages.source.synthetic import SERVER_PLACEHOLDER

pytestmark = pytest.mark.slow


def _build_config(tmp_path, urls, server, track_data: bool = False, line: bool = False) -> str:
    config = {"name": "build", "source": {"kind": "urls", "path": str(urls), "url_col": "url", "caption_col": "caption"},
              "ray": {"object_store_memory_mb": 256}, "track_data": track_data,
              "stages": {"ingest": {"allow_hosts": [server.netloc], "samples_per_shard": 30},
                         "dedup": {"eval_sets": []}, "basic": {"min_image_side": 16},
                         "clip_score": {"bootstrap": {"steps": 5}}, "tokenizer": {"vocab_size": 300},
                         "shard": {"samples_per_shard": 50, "append": line}}}
    if line:
        # a line keeps its first run's tokenizer; its CLIP score is a fixed threshold on a given score
        # (a scorer trained from the data, or a keep_fraction cut, is fitted afresh to the whole line
        # by a rebuild, so its samples could differ from the line's)
        config["stages"]["tokenizer"]["reuse"] = True
        config["stages"]["clip_score"] = {"scorer": "column", "column": "similarity", "threshold": 0.26,
                                          "keep_fraction": None}
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


def _list_file(path, rows, server) -> None:
    import hashlib

    pq.write_table(pa.table({"url": [r["url"].replace(SERVER_PLACEHOLDER, server.base_url) for r in rows],
                             "caption": [r["caption"] for r in rows],
                             "similarity": [0.25 + int(hashlib.sha256(r["url"].encode()).hexdigest()[:4], 16) % 100 / 1000
                                            for r in rows]}), path)


def test_a_dataset_line_is_rebuilt_to_its_shards_identical_then_names_what_changed_on_the_site(tmp_path):
    """A dataset line (a first run and two appends, as a scheduled run grows it), rebuilt: it stops at
    the shards (no model, no evaluation), says its drift before the stages after ingest run, names
    the rebuild and the drift in the card and the MLflow data-build run, and finds the line identical
    sample by sample (the rebuild lays the three runs' samples out in shards afresh).
    (A rebuild after the site changed: test_e2e_demo.py's test_rebuild_names_died_and_changed_urls.)"""
    rows = synthetic_rows(tmp_path / "site", 70, 3)
    urls, run, again = tmp_path / "urls", tmp_path / "run", tmp_path / "again"
    urls.mkdir()
    with DemoServer(tmp_path / "site" / "www") as server:
        config = _build_config(tmp_path, urls, server, track_data=True, line=True)
        for name, part in (("a", rows[:50]), ("b", rows[50:60]), ("c", rows[60:])):
            _list_file(urls / f"{name}.parquet", part, server)
            made = capline("run", config, "--run-dir", str(run), "--until", "shard", timeout=900)
            assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
        assert len(json.loads((run / "shard" / "shards.json").read_text())) >= 3     # each run of the line adds its own
        assert json.loads((run / "manifest.json").read_text())["selected"]["until"] == "shard"
        out = capline("rebuild", str(run), "--run-dir", str(again), timeout=900)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-3000:]
        assert "up to shard" in text
        assert not (again / "train").exists() and not (again / "eval").exists()
        assert "drift: 0 URLs died, 0 changed content, 0 came back" in out.stdout
        # the drift was said before the stages after ingest ran
        assert out.stdout.index("drift: ") < out.stdout.index("dedup: running")
        assert "shards: identical to the original sample by sample" in out.stdout, out.stdout[-2000:]
        report = json.loads((again / "drift.json").read_text())
        assert report["counts"] == {"died": 0, "changed": 0, "revived": 0}
        kept = sum(s["samples"] for s in json.loads((run / "shard" / "shards.json").read_text()))
        assert report["shards"]["identical"] and report["shards"]["samples"] == kept == report["shards"]["rebuilt"]
        card = (again / "shard" / "README.md").read_text()
        assert "## Rebuild" in card and str(run) in card and "0 URLs died" in card
        import mlflow

        c = mlflow.tracking.MlflowClient(f"sqlite:///{again / 'mlflow.db'}")
        data_run = c.get_run(json.loads((again / "manifest.json").read_text())["mlflow_runs"]["data"])
        assert data_run.data.tags["capline.rebuild_of"] == str(run)
        assert data_run.data.metrics["drift.died"] == 0 and data_run.data.metrics["drift.changed"] == 0

    bad = capline("rebuild", str(run), "--run-dir", str(tmp_path / "x"), "--until", "shrad")
    assert bad.returncode != 0 and "--until shrad: no such stage" in bad.stdout + bad.stderr
