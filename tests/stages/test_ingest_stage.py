"""Stage level: source + ingest on a temp dir with a real local Ray, img2dataset and loopback server."""
import hashlib
import json
import tarfile

import pyarrow.parquet as pq
import pytest

from stages.base import read_ledger
import webdataset as wds

from pipeline.config import load_config
from pipeline.runner import run_pipeline
from stages.source.demo_server import DemoServer
from stages.source.synthetic import SERVER_PLACEHOLDER

pytestmark = pytest.mark.slow

# What ingest must make of each planted defect (None: downloads fine, later stages judge it: the
# basic stage alone decides empty_caption and image_too_small, as the README says).
EXPECTED = {
    "clean": None, "mismatched_caption": None, "non_english": None, "eval_near_copy": None,
    "http_404": "http_404", "http_500": "http_500", "timeout": "timeout",
    "corrupt": "undecodable_image", "truncated": "truncated_image", "non_image": "not_an_image",
    "tiny": None, "empty_caption": None,
    "huge_pixels": "image_too_large", "huge_bytes": "too_many_bytes",
    "repeat_row": None, "train_near_copy": None, "eval_caption": None,    # a caption leak is dedup's
}

SMALL = ["source.num_samples=300", "source.eval_size=20", "source.slow_seconds=4",
         "stages.ingest.timeout=2", "stages.ingest.samples_per_shard=60"]


def _ledger(run_dir, stage):
    return {r["key"]: r for r in read_ledger(run_dir, stage).to_pylist()}


def test_every_planted_defect_gets_its_reason(tmp_path, ray_local):
    cfg = load_config(None, SMALL)
    summary = run_pipeline(cfg, tmp_path, until="ingest", log=lambda m: None)
    ing = summary["ingest"]
    assert ing["in"] == ing["kept"] + sum(ing["dropped"].values()) == 300
    ledger = _ledger(tmp_path, "ingest")
    truth = pq.read_table(tmp_path / "source" / "_ground_truth.parquet").to_pylist()
    planted = {r["defect"] for r in truth}
    assert {"http_404", "corrupt", "truncated", "non_image", "huge_pixels", "huge_bytes"} <= planted
    for row in truth:
        got = ledger[row["key"]]
        want = EXPECTED[row["defect"]]
        if want is None:
            assert got["verdict"] == "kept", (row, got)
        else:
            assert (got["verdict"], got["reason"]) == ("dropped", want), (row, got)

    # Shards: whole tars only, nothing left in staging, readable by webdataset, one per kept key.
    shards = sorted((tmp_path / "ingest").glob("parts/*/shards/*.tar"))
    assert len(shards) == 5
    assert not list((tmp_path / "ingest").glob("parts/*/shards/*.tmp*"))
    seen = []
    for sample in wds.WebDataset([str(s) for s in shards], shardshuffle=False):
        meta = json.loads(sample["json"])
        assert sample["jpg"][:2] == b"\xff\xd8"
        assert "." not in sample["__key__"]
        seen.append(meta["uid"])
    kept = sorted(k for k, r in ledger.items() if r["verdict"] == "kept")
    assert sorted(seen) == kept
    for s in shards:
        with tarfile.open(s) as t:
            assert len(t.getmembers()) > 0
    # the sample index: each kept key's image, read by byte range, is the member's bytes
    for r in [r for r in ledger.values() if r["verdict"] == "kept"][:20]:
        with open(tmp_path / r["tar"], "rb") as f:
            f.seek(r["offset"])
            data = f.read(r["size"])
        with tarfile.open(tmp_path / r["tar"]) as t:
            assert t.extractfile(r["member"]).read() == data
        assert r["width"] and r["height"] and len(r["sha256"]) == 64
    # the failures by host are in the report, not in what the driver holds per shard
    report = (tmp_path / "ingest" / "report.html").read_text()
    assert "http_404" in report and "By host and reason" in report
    results = [json.loads(f.read_text()) for f in (tmp_path / "ingest").glob("parts/*/results/*.json")]
    assert results and all(set(r["extra"]) <= {"node", "successes", "paced_thread_s", "paced_idle_s", "paced_yielded_s"}
                           for r in results)                     # counts only, no tables


def test_the_ingest_report_table_is_merged_beside_the_shards_and_kept_per_unit(tmp_path):
    """Units' tables merged in a task; an unchanged unit is read as one file next time; a shard
    written by an older version (its table in its result) still counts; the table stays bounded."""
    from infra.storage import Storage
    from stages.ingest.stage import PARTS, REPORT_PAIRS, _failure_tables

    storage = Storage.local(tmp_path)
    for i in range(2):
        storage.write_json(f"{PARTS}/a/failures/{i:05d}.json", {
            "failures": {f"h{i}.example\thttp_404": 3, "x.example\ttimeout": 1}, "failures_other": 2,
            "failure_examples": {"http_404": [{"key": f"k{i}", "url": "u", "detail": "d"}]},
            "throttled": {"x.example": [1, 2.5]}, "paced": {"x.example": 3.0 - 1.5 * i}})
    storage.write_json(f"{PARTS}/b/results/00000.json", {"extra": {"failures": {"y.example\thttp_500": 4}}})
    storage.write_json(f"{PARTS}/c/failures/00000.json",
                       {"failures": {f"z{i}.example\ttimeout": 1 for i in range(REPORT_PAIRS + 10)}})
    got = _failure_tables(storage, {"a": ["00000", "00001"], "b": ["00000"], "c": ["00000"]})
    assert got["failures"]["x.example\ttimeout"] == 2 and got["failures"]["y.example\thttp_500"] == 4
    assert len(got["failures"]) == REPORT_PAIRS and got["failures_other"] == 4 + 14    # 2 a shard, 14 cut
    assert [e["key"] for e in got["failure_examples"]["http_404"]] == ["k0", "k1"]
    assert got["throttled"] == {"x.example": [2, 5.0]}
    assert got["paced"] == {"x.example": 1.5}                 # the slowest pace a shard ended at
    (tmp_path / PARTS / "a" / "failures" / "00000.json").unlink()     # unit a is read from its merged file now
    assert _failure_tables(storage, {"a": ["00000", "00001"], "b": ["00000"], "c": ["00000"]}) == got


def test_urls_source_csv_with_allow_list(tmp_path, ray_local):
    """kind: urls reads a CSV with other column names; refused addresses and empty URLs are recorded."""
    from stages.source import synthetic
    from stages.source.stage import DefectFractions

    none = {k: 0 for k in vars(DefectFractions())}
    synthetic.generate(tmp_path / "site", 40, 5, 48, 3, none, 100, 100)
    rows = pq.read_table(tmp_path / "site" / "urls.parquet").to_pylist()
    with DemoServer(tmp_path / "site" / "www") as server:
        lines = ["image_url,alt"]
        for r in rows:
            lines.append(f"{r['url'].replace(SERVER_PLACEHOLDER, server.base_url)},\"{r['caption']}\"")
        lines.append("http://10.0.0.7/private.jpg,a private address")
        lines.append("http://169.254.169.254/latest/meta-data/,metadata")
        lines.append(",no url at all")
        lines.append(f"{server.base_url}/img/{rows[0]['key']}.jpg,\"{rows[0]['caption']}\"")  # a repeat
        csv = tmp_path / "urls.csv"
        csv.write_text("\n".join(lines) + "\n")
        cfg = load_config(None, [
            "source.kind=urls", f"source.path={csv}", "source.url_col=image_url", "source.caption_col=alt",
            f"stages.ingest.allow_hosts=['{server.netloc}']", "stages.ingest.samples_per_shard=20"])
        summary = run_pipeline(cfg, tmp_path / "run", until="ingest", log=lambda m: None)
    assert summary["source"]["dropped"] == {"malformed_row:missing_url": 1}
    assert summary["ingest"]["kept"] == 41
    assert summary["ingest"]["dropped"] == {"unsafe_url:private_address": 1, "unsafe_url:metadata_address": 1}
    keys = list(_ledger(tmp_path / "run", "ingest"))
    assert any(k.endswith("_1") for k in keys)  # the repeated pair got its own key


def _content(run_dir):
    out = {}
    for sample in wds.WebDataset(sorted(str(p) for p in (run_dir / "ingest").glob("parts/*/shards/*.tar")),
                                 shardshuffle=False):
        out[json.loads(sample["json"])["uid"]] = hashlib.sha256(sample["jpg"]).hexdigest()
    return out


def test_rerun_resumes_only_missing_shards(tmp_path, ray_local):
    cfg = load_config(None, SMALL + ["stages.ingest.compact_rows=120"])
    logs = []
    run_pipeline(cfg, tmp_path, until="ingest", log=logs.append)
    # 5 shards of 60, compact_rows 120: 2 shards a partition for the stages after
    assert any("ingest: 5 shards joined into 3 partitions" in m for m in logs), logs
    parts = json.loads((tmp_path / "ingest" / "parts.json").read_text())
    assert [p["in"] for p in parts] == [120, 120, 60]
    shard_keys = {r["key"] for f in sorted(tmp_path.glob("ingest/parts/*/ledger/*.parquet"))
                  for r in pq.read_table(f, columns=["key"]).to_pylist()}
    assert {r["key"] for p in parts for r in pq.read_table(tmp_path / p["file"], columns=["key"]).to_pylist()} == shard_keys
    before = _content(tmp_path)
    (part,) = (p for p in (tmp_path / "ingest" / "parts").iterdir() if p.is_dir())   # beside: _summary.parquet
    shards = part / "shards"
    # Simulate a kill mid-ingest: the stage marker gone, one shard never finished (no result), its tar half written,
    # and no summary of the stage's records (the driver writes it once the stage's tasks are done)
    (tmp_path / "ingest" / "_SUCCESS").unlink()
    (tmp_path / "ingest" / "parts" / "_summary.parquet").unlink()
    (part / "results" / "00002.json").unlink()
    (shards / "00002.tar").write_bytes(b"half a tar")
    untouched = (shards / "00001.tar").stat().st_mtime_ns
    logs = []
    run_pipeline(cfg, tmp_path, until="ingest", log=logs.append)
    assert any("4 shards downloaded before, reused; 1 to download" in m for m in logs), logs
    assert json.loads((tmp_path / "ingest" / "parts.json").read_text())[0] == parts[0]   # its group: reused
    assert (shards / "00001.tar").stat().st_mtime_ns == untouched
    assert _content(tmp_path) == before


def test_a_list_of_private_urls_stops_after_ingest_naming_allow_hosts(tmp_path, ray_local):
    """Every URL on a loopback mirror and no allow_hosts: the run ends after ingest in one line that
    names the setting, instead of running four more stages on nothing."""
    from stages.source import synthetic
    from stages.source.stage import DefectFractions
    from infra.errors import UserError

    none = {k: 0 for k in vars(DefectFractions())}
    synthetic.generate(tmp_path / "site", 30, 5, 48, 3, none, 100, 100)
    rows = pq.read_table(tmp_path / "site" / "urls.parquet").to_pylist()
    with DemoServer(tmp_path / "site" / "www") as server:
        csv = tmp_path / "urls.csv"
        csv.write_text("url,caption\n" + "".join(f"{r['url'].replace(SERVER_PLACEHOLDER, server.base_url)},"
                                                 f"\"{r['caption']}\"\n" for r in rows))
        cfg = load_config(None, ["source.kind=urls", f"source.path={csv}", "stages.ingest.samples_per_shard=20"])
        said = []
        with pytest.raises(UserError) as err:
            run_pipeline(cfg, tmp_path / "run", log=said.append)
    message = str(err.value)
    assert message.startswith("ingest kept nothing (most as unsafe_url:private_address: 30 of 30)")
    assert "stages.ingest.allow_hosts" in message and "\n" not in message
    assert (tmp_path / "run" / "ingest" / "_SUCCESS").exists()       # its verdicts are kept
    assert not any(line.startswith("dedup:") for line in said)        # nothing ran after it


def test_a_list_under_one_shard_shows_its_urls_and_an_eta_while_it_downloads(tmp_path, ray_local):
    """One shard of 20 URLs that answer in 0.7 s each, fetched one at a time (~14 s): the progress
    counts URLs as they finish, with a rate and an ETA, where it said '0/1 done' until the end."""
    import re

    from stages.source import synthetic
    from stages.source.stage import DefectFractions

    synthetic.generate(tmp_path / "site", 20, 5, 48, 3, {k: 0 for k in vars(DefectFractions())}, 100, 100)
    rows = pq.read_table(tmp_path / "site" / "urls.parquet").to_pylist()
    said = []
    with DemoServer(tmp_path / "site" / "www", slow_seconds=0.7) as server:
        (tmp_path / "urls.csv").write_text("url,caption\n" + "".join(
            f"{server.base_url}/slow/{r['url'].rsplit('/', 1)[1]},\"{r['caption']}\"\n" for r in rows))
        cfg = load_config(None, ["source.kind=urls", f"source.path={tmp_path / 'urls.csv'}",
                                 f"stages.ingest.allow_hosts=['{server.netloc}']", "stages.ingest.thread_count=1",
                                 "stages.ingest.timeout=5"])
        summary = run_pipeline(cfg, tmp_path / "run", until="ingest", log=said.append)
    assert summary["ingest"]["kept"] == 20
    midway = [m for m in said if (g := re.match(r"ingest: (\d+)/20 URLs, [\d.]+/s, ETA \S+", m)) and 0 < int(g[1]) < 20]
    assert midway, [m for m in said if m.startswith("ingest")]
    assert any(m.startswith("ingest: 20/20 URLs") for m in said)
