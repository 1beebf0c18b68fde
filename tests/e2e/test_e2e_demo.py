"""End to end through the real CLI: the demo source, a local Ray cluster, img2dataset on loopback.

Includes the kill test: SIGKILL to the driver in the middle of ingest, the same command again, and
the final shards hold exactly the samples (same keys, same image bytes) of an uninterrupted run.
"""
import hashlib
import json
import os
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from stages.base import read_ledger
import webdataset as wds

from helpers import ROOT, capline, kill_driver, eval_index_cache

pytestmark = pytest.mark.slow

ARGS = ["--set", "source.num_samples=600", "--set", "source.eval_size=30", "--set", "source.slow_seconds=4",
        "--set", "stages.ingest.timeout=2", "--set", "stages.ingest.samples_per_shard=40",
        "--set", "stages.shard.samples_per_shard=130", "--set", "train.steps=0",
        "--set", "stages.clip_score.bootstrap.steps=50",
        "--set", f"stages.dedup.cache_dir={eval_index_cache()}"]


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
    # 600 samples leave ~480 pairs for the bootstrap scorer: under the measured 800, it says so
    scorer_stats = json.loads((run_dir / "clip_score" / "stats.json").read_text())
    n = scorer_stats["scorer"]["trained_on"]
    assert n < 800 and scorer_stats["warning"].startswith(f"the bootstrap scorer learnt from {n} pairs; below 800")
    assert f"clip_score: warning: the bootstrap scorer learnt from {n} pairs" in proc.stdout
    assert "stages.clip_score.scorer to hf, checkpoint or column" in proc.stdout
    stats = json.loads((run_dir / "ingest" / "stats.json").read_text())
    assert stats["in"] == stats["kept"] + sum(stats["dropped"].values()) == 600
    for reason in ("http_404", "http_500", "timeout", "undecodable_image", "truncated_image",
                   "not_an_image", "image_too_large", "too_many_bytes"):
        assert stats["dropped"].get(reason, 0) > 0, (reason, stats)
    # each drop decided once, in the stage the README names: caption and image size are basic's
    basic = json.loads((run_dir / "basic" / "stats.json").read_text())
    for reason in ("empty_caption", "image_too_small"):
        assert basic["dropped"].get(reason, 0) > 0 and reason not in stats["dropped"], (reason, basic, stats)
    details = read_ledger(run_dir, "ingest", ["reason", "detail"]).to_pylist()
    assert not [d for d in details if " at 0x" in (d["detail"] or "") or (d["detail"] or "").startswith("capline:")]
    assert any("max_pixels" in d["detail"] for d in details if d["reason"] == "image_too_large")
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
    # a duplicate names the copy kept in its place by key and by URL
    from stages.base import read_ledger

    dedup = read_ledger(run_dir, "dedup", ["key", "reason", "match_key"]).to_pylist()
    dup = next(r for r in dedup if r["reason"] in ("exact_duplicate", "near_duplicate"))
    kept_url = read_ledger(run_dir, "source", ["url"], filters=[("key", "==", dup["match_key"])]).column("url")[0].as_py()
    out = capline("explain", str(run_dir), dup["key"])
    assert f"the copy kept: {dup['match_key']} {kept_url}" in out.stdout, out.stdout


def test_rerun_of_a_finished_run_skips_everything(reference_run):
    run_dir, _ = reference_run
    before = (run_dir / "ingest" / "_SUCCESS").read_text()
    proc = capline("run", "--run-dir", str(run_dir), *ARGS)
    assert proc.returncode == 0
    assert "source: done before with the same input, skipped" in proc.stdout
    assert "ingest: done before with the same input, skipped" in proc.stdout
    assert (run_dir / "ingest" / "_SUCCESS").read_text() == before


def test_the_filters_run_twice_keep_the_same_keys_and_train_the_same_scorer(reference_run, tmp_path):
    """basic, language and clip_score run again on a copy of the run (their folders removed): the
    same kept keys, and a bootstrap scorer trained again to the same bytes."""
    import shutil

    run_dir, _ = reference_run
    kept = {s: sorted(r["key"] for r in read_ledger(run_dir, s).to_pylist() if r["verdict"] == "kept")
            for s in ("basic", "language", "clip_score")}
    sha = json.loads((run_dir / "clip_score" / "stats.json").read_text())["scorer"]["sha256"]
    copy = tmp_path / "again"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("basic", "language", "clip_score"))
    proc = capline("run", "--run-dir", str(copy), *ARGS, "--until", "clip_score")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "basic: running" in proc.stdout and "clip_score: training the bootstrap scorer" in proc.stdout
    for stage, keys in kept.items():
        assert sorted(r["key"] for r in read_ledger(copy, stage).to_pylist() if r["verdict"] == "kept") == keys, stage
    assert json.loads((copy / "clip_score" / "stats.json").read_text())["scorer"]["sha256"] == sha


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
    # the data-build run opened when the source stage finished, and shows it while ingest runs
    from mlflow import MlflowClient

    mlflow = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    live = json.loads((run_dir / "manifest.json").read_text())["mlflow_runs"]["data_live"]
    opened = mlflow.get_run(live)
    assert opened.info.status == "RUNNING" and opened.data.metrics["source.in"] == 600
    assert opened.data.tags["capline.kind"] == "data-build"

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
    # the same run, continued through the interruptions, now complete with the dataset's digest
    runs = json.loads((run_dir / "manifest.json").read_text())["mlflow_runs"]
    assert runs["data"] == live and "data_live" not in runs
    done = mlflow.get_run(live)
    assert done.info.status == "FINISHED" and done.data.tags["capline.dataset_digest"]
    assert done.data.metrics["shard.kept"] > 0 and done.data.metrics["dedup.in"] > 0


def test_final_shards_read_back_once_per_epoch(reference_run):
    """With the plain WebDataset reader, and with a loader written the way open_clip's is."""
    import torch

    run_dir, _ = reference_run
    sizes = json.loads((run_dir / "shard" / "shards" / "sizes.json").read_text())
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
    # named by URL (a key is capline's), printed and in drift.json
    name = lambda urls: [u.rsplit("/", 1)[1].removesuffix(".jpg") for u in urls]   # noqa: E731
    assert name(report["died"]) == sorted(removed) and name(report["changed"]) == sorted(changed)
    assert "2 URLs died, 3 changed content" in out.stdout
    assert all(u in out.stdout for u in report["died"] + report["changed"])
    # and the shards compared sample by sample: the removed samples are only in the original
    assert not report["shards"]["identical"] and report["shards"]["only_in_original"] >= 2
    assert "samples differ" in out.stdout


def _open_clip_dataset_size(pattern: str) -> int:
    """open_clip's get_dataset_size rule, restated: expand the brace pattern, read `sizes.json` in the
    first shard's folder, sum the listed sizes of the shards named (a shard missing there is a KeyError)."""
    import braceexpand

    shards = list(braceexpand.braceexpand(pattern))
    sizes = json.loads(open(os.path.join(os.path.dirname(shards[0]), "sizes.json")).read())
    return sum(int(sizes[os.path.basename(s)]) for s in shards)


def test_the_printed_open_clip_line_and_wids_read_the_shards(reference_run):
    import shlex

    import wids

    run_dir, proc = reference_run
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("open_clip: "))
    assert not line.rstrip().endswith("...")            # pasted as printed, it runs
    args = shlex.split(line.split("open_clip_train.main", 1)[1])
    opts = dict(zip(args[::2], args[1::2]))
    assert opts["--dataset-type"] == "webdataset"
    n = int(opts["--train-num-samples"])
    assert _open_clip_dataset_size(opts["--train-data"]) == n
    # open_clip's pipeline shape: shard list, tar to samples, decode, rename, to_tuple
    ds = wds.DataPipeline(wds.SimpleShardList(opts["--train-data"]), wds.tarfile_to_samples(), wds.decode("pilrgb"),
                          wds.rename(image="jpg;png;jpeg;webp", text="txt"), wds.to_tuple("image", "text"))
    got = list(ds)
    assert len(got) == n and all(img.size == (64, 64) and txt for img, txt in got)
    index = json.loads((run_dir / "shard" / "shards" / "shardindex.json").read_text())
    assert index["__kind__"] == "wids-shard-index-v1"
    ds = wids.ShardListDataset(str(run_dir / "shard" / "shards" / "shardindex.json"))
    assert len(ds) == n
    sample = ds[n - 1]
    meta = sample[".json"]   # wids decodes .json members itself
    assert sample[".txt"] and (meta if isinstance(meta, dict) else json.loads(meta))["key"] == sample["__key__"]


def test_per_sample_json_has_img2datasets_fields_and_the_fetched_url(reference_run):
    run_dir, _ = reference_run
    metas = [json.loads(s["json"]) for s in wds.WebDataset(str(run_dir / "shard" / "shards" / "000000.tar"),
                                                           shardshuffle=False)]
    assert metas
    for m in metas:
        assert m["status"] == "success" and m["error_message"] is None
        assert m["url"].startswith("http://127.0.0.1:") and "{" not in m["url"]
        assert (m["width"], m["height"]) == (64, 64) and m["original_width"] == m["original_height"] == 96
        assert len(m["sha256"]) == 64 and 0 <= m["language_score"] <= 1 and "clip_score" in m
        assert "clip_score_score" not in m and "ingest_detail" not in m
    card = (run_dir / "shard" / "README.md").read_text()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"]["shard"]["output_digest"] in card
    assert manifest["artifacts"]["clip_score"]["scorer_sha256"] in card
    assert "min_image_side=" in card and "| demo |" in card


def test_verify_of_a_truncated_copy_never_says_identical(reference_run, tmp_path):
    import shutil

    run_dir, _ = reference_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("ingest", "mlflow.db", "mlartifacts"))
    same = capline("verify", str(run_dir), str(copy))
    assert same.returncode == 0 and "identical" in same.stdout, same.stdout + same.stderr
    tar = copy / "shard" / "shards" / "000001.tar"
    with open(tar, "r+b") as f:
        f.truncate(tar.stat().st_size // 2)
    proc = capline("verify", str(run_dir), str(copy))
    assert proc.returncode == 1, proc.stdout
    assert "identical" not in proc.stdout
    assert "000001.tar" in proc.stdout and "truncated" in proc.stdout


def test_status_and_explain_as_json_by_url_and_stale_stages(reference_run, tmp_path):
    import shutil

    run_dir, _ = reference_run
    rows = json.loads(capline("status", str(run_dir), "--json").stdout)
    assert [r["state"] for r in rows] == ["done"] * len(rows)
    kept = read_ledger(run_dir, "shard", ["key", "tar", "offset"]).to_pylist()[0]
    url = read_ledger(run_dir, "ingest", ["key", "url"], filters=[("key", "==", kept["key"])]).to_pylist()[0]["url"]
    proc = capline("explain", str(run_dir), "--url", url, "--json")
    assert proc.returncode == 0, proc.stderr
    last = [r for r in json.loads(proc.stdout) if r["stage"] == "shard"][0]
    assert (last["tar"], last["offset"]) == (kept["tar"], kept["offset"])
    with open(run_dir / last["tar"], "rb") as f:      # the offset is the sample's first tar header
        f.seek(last["offset"])
        assert f.read(100).rstrip(b"\0").decode().startswith(kept["key"] + ".")
    copy = tmp_path / "stale"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("ingest", "mlartifacts"))
    (copy / "shard" / "_SUCCESS").unlink()
    states = {r["stage"]: r["state"] for r in json.loads(capline("status", str(copy), "--json").stdout)}
    assert states["shard"] == "incomplete" and states["train"] == states["eval"] == "stale", states
    assert "stale" in capline("status", str(copy)).stdout


def test_closed_pipe_version_and_stage_names_in_help(reference_run):
    run_dir, _ = reference_run
    key = read_ledger(run_dir, "shard", ["key"]).column("key")[0].as_py()
    for cmd in (f"status {run_dir} --json", f"explain {run_dir} {key} --json"):
        proc = subprocess.run(f"{ROOT}/.venv/bin/capline {cmd} | head -c 10", shell=True, capture_output=True,
                              text=True, timeout=120)
        assert len(proc.stdout) == 10 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert capline("--version").stdout.startswith("capline ")
    from pipeline.runner import stage_names

    helptext = capline("run", "--help").stdout
    assert all(name in helptext for name in stage_names())


def test_a_successful_run_prints_no_ray_noise(reference_run):
    _, proc = reference_run
    out = proc.stdout + proc.stderr
    for noise in ("TrainController", "core_worker.cc", "Reporting training result", "RpcError",
                  "INFO mlflow", "(pid="):
        assert noise not in out, noise
    assert out.count("capline: finished") == 1


def test_train_on_a_run_folder_uses_its_own_config(reference_run):
    """No CONFIG, no --set: `capline train --run-dir` takes the run's config.yaml (here train.steps=0
    and 600 samples), so the earlier stages count as done; the demo's defaults would not match them."""
    run_dir, _ = reference_run
    proc = capline("train", "--run-dir", str(run_dir), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"using {run_dir}'s own config" in proc.stdout and "train: done before with the same input" in proc.stdout
    wrong = capline("train", str(ROOT / "configs" / "demo.yaml"), "--run-dir", str(run_dir), timeout=120)
    assert wrong.returncode == 2 and "finished with another config" in wrong.stderr and "ray:" not in wrong.stdout
