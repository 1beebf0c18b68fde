"""End to end: a run whose source is a URL list, evaluated on the sets its config declares: a
folder of class subfolders (few-shot, zero-shot) and a COCO-format captions file (captioning, and
ARO word order generated from it). Every task runs on them; nothing is skipped silently."""
import json
import shutil

import pyarrow.parquet as pq
import pytest

from pipeline.config import load_config
from pipeline.runner import run_pipeline
from stages.source import synthetic
from stages.source.demo_server import DemoServer
from stages.source.stage import DefectFractions
from stages.source.synthetic import SERVER_PLACEHOLDER

pytestmark = pytest.mark.slow


def test_declared_evaluation_sets_on_a_url_list_run(tmp_path, ray_local):
    fr = {k: 0 for k in vars(DefectFractions())}
    synthetic.generate(tmp_path / "site", 240, 40, 48, 7, fr, 100, 100)
    rows = pq.read_table(tmp_path / "site" / "urls.parquet").to_pylist()
    held = pq.read_table(tmp_path / "site" / "eval" / "eval.parquet").to_pylist()
    classes = tmp_path / "shapes"                       # a user's class-folder set
    for r in held:
        (classes / r["shape"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "site" / "eval" / r["path"], classes / r["shape"] / f"{r['id']}.png")
    coco = tmp_path / "site" / "eval" / "captions.json"   # a user's COCO captions file
    assert json.loads(coco.read_text())["annotations"]
    eval_section = json.dumps({
        "fewshot": [{"name": "shapes", "kind": "folder", "path": str(classes)}],
        "captioning": [{"name": "mycoco", "kind": "coco", "path": str(coco), "images": str(coco.parent)}],
        "zeroshot": [{"name": "shapes", "kind": "folder", "path": str(classes),
                      "templates": ["a small red {}", "a large blue {}"]}],
        "wordorder": [{"name": "mycoco_order", "kind": "aro", "source": "mycoco"}],
        "shots": [1, 2], "seeds": 2, "lit_decoder": {"steps": 10, "batch_size": 16},
        "lit": {"steps": 10, "batch_size": 16}, "map_probe": {"steps": 10, "shots": 2}})
    with DemoServer(tmp_path / "site" / "www") as server:
        (tmp_path / "urls.csv").write_text("url,caption\n" + "".join(
            f"{r['url'].replace(SERVER_PLACEHOLDER, server.base_url)},\"{r['caption']}\"\n" for r in rows))
        cfg = load_config(None, [
            "source.kind=urls", f"source.path={tmp_path / 'urls.csv'}", f"stages.ingest.allow_hosts=['{server.netloc}']",
            "stages.ingest.samples_per_shard=120", "stages.tokenizer.vocab_size=300",
            f"stages.dedup.cache_dir={tmp_path / 'cache'}", "stages.dedup.eval_sets=[{name: digits, kind: builtin, path: digits}]",
            "stages.clip_score.bootstrap.steps=10", "train.model=cappa", "train.steps=10", "train.checkpoint_every=10",
            "train.image_size=32", "train.model_args={width: 32, depth: 2, heads: 2, mlp: 64, patch: 8}",
            "train.max_len=24", "train.global_batch=16", "train.sample_every=0", f"eval={eval_section}"])
        logs = []
        run_pipeline(cfg, tmp_path / "run", log=logs.append)
    results = json.loads(next((tmp_path / "run" / "eval").glob("*.json")).read_text())
    assert results["skipped"] == [], results["skipped"]
    assert set(results["fewshot"]["shapes"]) == {"1", "2"} and set(results["fewshot_map"]["shapes"]) == {"2"}
    assert set(results["captioning"]["mycoco"]) == {"greedy", "beam4", "lit_greedy", "lit_beam4"}
    assert set(results["zeroshot"]["shapes"]) >= {"ar", "parallel", "lit"}
    assert results["zeroshot"]["shapes"]["classes"] == 3
    from trainers.evaluation.aro import KINDS

    aro = results["wordorder"]["mycoco_order"]
    assert set(aro["pairwise"]) <= set(KINDS) and len(aro["pairwise"]) >= 3 and aro["precision_at_1"]["n"] > 0
    assert not any("skipped" in m for m in logs)
    for task in ("few-shot probes", "captioning", "zero-shot", "word order"):   # progress, task by task
        assert any(m.startswith(f"eval: {task} on ") for m in logs) and any(
            m.startswith(f"eval: {task} done (") for m in logs), task
    # small data (~200 samples, 500 a shard): still stages.shard.min_shards (4) shards, one per worker
    assert len(list((tmp_path / "run" / "shard" / "shards").glob("*.tar"))) == 4
    assert any("(stages.shard.min_shards), one per training worker" in m for m in logs)
