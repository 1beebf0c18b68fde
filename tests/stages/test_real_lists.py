"""URL lists as real users have them, to shards with no workaround: a headerless CC3M-style TSV (its
first row is a sample) and a LAION-style Parquet with extra columns (LICENSE, WIDTH, punsafe) and a
`similarity` column the CLIP-score stage uses as its score. Served from a loopback web server."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from pipeline.config import load_config
from pipeline.runner import run_pipeline
from stages.source.demo_server import DemoServer
from stages.source.synthetic import SERVER_PLACEHOLDER

pytestmark = pytest.mark.slow

COMMON = ["stages.ingest.samples_per_shard=20", "stages.dedup.eval_sets=[]", "stages.basic.min_image_side=16",
          "stages.language.enabled=false", "stages.tokenizer.vocab_size=300", "stages.shard.samples_per_shard=100",
          "track_data=false"]


def _site(tmp_path, n):
    from stages.source import synthetic
    from stages.source.stage import DefectFractions

    synthetic.generate(tmp_path / "site", n, 5, 48, 3, {k: 0 for k in vars(DefectFractions())}, 100, 100)
    return pq.read_table(tmp_path / "site" / "urls.parquet").to_pylist()


def _samples(run_dir):
    shards = sorted(str(p) for p in (run_dir / "shard" / "shards").glob("*.tar"))
    return {json.loads(s["json"])["url"]: json.loads(s["json"]) for s in wds.WebDataset(shards, shardshuffle=False)}


def test_cc3m_tsv_and_laion_parquet_to_shards(tmp_path, ray_local):
    rows = _site(tmp_path, 40)
    with DemoServer(tmp_path / "site" / "www") as server:
        urls = [r["url"].replace(SERVER_PLACEHOLDER, server.base_url) for r in rows]
        allow = f"stages.ingest.allow_hosts=['{server.netloc}']"

        tsv = tmp_path / "cc3m" / "Train_GCC-training.tsv"
        tsv.parent.mkdir()
        tsv.write_text("".join(f"{r['caption']}\t{u}\n" for r, u in zip(rows[:20], urls[:20])))
        cfg = load_config(None, ["source.kind=urls", f"source.path={tsv}", "source.header=false",
                                 "source.url_col=1", "source.caption_col=0", allow, *COMMON,
                                 "stages.clip_score.enabled=false"])
        run_pipeline(cfg, tmp_path / "cc3m-run", until="shard", log=lambda m: None)
        got = _samples(tmp_path / "cc3m-run")
        assert urls[0] in got and got[urls[0]]["caption"] == rows[0]["caption"]     # the first row is a sample
        assert len(got) == 20

        laion = tmp_path / "laion" / "part-00000.parquet"
        laion.parent.mkdir()
        similarity = [round(0.2 + 0.01 * i, 4) for i in range(20)]
        # LAION's own recipe on its own columns: punsafe <= 0.5, pwatermark <= 0.8 (one row has no pwatermark)
        punsafe = [0.01] * 16 + [0.7, 0.01, 0.01, 0.93]
        pwatermark = [0.1] * 17 + [0.95, None, 0.1]
        pq.write_table(pa.table({"URL": urls[20:], "TEXT": [r["caption"] for r in rows[20:]],
                                 "LICENSE": ["CC-BY"] * 10 + ["?"] * 10, "WIDTH": [96] * 20, "HEIGHT": [96] * 20,
                                 "similarity": similarity, "punsafe": punsafe,
                                 "pwatermark": pa.array(pwatermark, pa.float64())}), laion)
        cfg = load_config(None, ["source.kind=urls", f"source.path={laion}", "source.url_col=URL",
                                 "source.caption_col=TEXT", allow, *COMMON, "stages.clip_score.scorer=column",
                                 "stages.clip_score.column=similarity", "stages.clip_score.threshold=0.28",
                                 "stages.clip_score.keep_fraction=null",
                                 "source.where={punsafe: {max: 0.5}, pwatermark: {max: 0.8}}"])
        summary = run_pipeline(cfg, tmp_path / "laion-run", until="shard", log=lambda m: None)
    got = _samples(tmp_path / "laion-run")
    allowed = [p <= 0.5 and w is not None and w <= 0.8 for p, w in zip(punsafe, pwatermark)]
    assert summary["source"]["dropped"] == {"list_filter:punsafe": 2, "list_filter:pwatermark": 2}
    kept = {u for u, s, ok in zip(urls[20:], similarity, allowed) if s >= 0.28 and ok}
    assert set(got) == kept and summary["clip_score"]["dropped"] == {"clip_score": sum(allowed) - len(kept)}
    from stages.base import read_ledger

    why = {r["url"]: r["detail"] for r in read_ledger(tmp_path / "laion-run", "source").to_pylist() if r["reason"]}
    assert why[urls[36]].endswith("punsafe 0.7 > max 0.5 (source.where)")
    assert why[urls[38]].endswith("pwatermark has no value (source.where)")
    card = (tmp_path / "laion-run" / "shard" / "README.md").read_text()
    assert "list_filter:punsafe=2" in card and "punsafe" in card.split("## Filters and thresholds")[1]
    sample = got[sorted(kept)[0]]
    assert sample["LICENSE"] in ("CC-BY", "?") and sample["WIDTH"] == 96 and sample["punsafe"] == 0.01
    assert sample["clip_score"] == sample["similarity"]      # the list's score is the filter's score
    assert summary["clip_score"]["scorer"]["kind"] == "column"
