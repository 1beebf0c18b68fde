"""`capline remove` on a published dataset line: items removed by URL, key, sha256 and a perceptual
match to a re-encoded, resized copy; only the shards that held them change; the next append with the
same URLs (and a near copy of a removed image under a new URL) does not bring them back. Then the
site's robots.txt opts out of two images: `capline recheck` removes those and nothing else."""
import hashlib
import io
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from helpers import capline, synthetic_rows
from stages.source.demo_server import DemoServer
from stages.source.synthetic import SERVER_PLACEHOLDER

pytestmark = pytest.mark.slow


def _config(tmp_path, urls, server) -> str:
    config = {"name": "line", "source": {"kind": "urls", "path": str(urls), "url_col": "url", "caption_col": "caption"},
              "ray": {"object_store_memory_mb": 256}, "track_data": True,
              "stages": {"ingest": {"allow_hosts": [server.netloc], "samples_per_shard": 20},
                         "dedup": {"eval_sets": []}, "basic": {"min_image_side": 16},
                         "clip_score": {"scorer": "column", "column": "similarity", "threshold": 0.2,
                                        "keep_fraction": None},
                         "tokenizer": {"vocab_size": 300, "reuse": True},
                         "shard": {"samples_per_shard": 10, "append": True}}}
    (tmp_path / "line.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "line.yaml")


def _list(path, rows, server) -> None:
    pq.write_table(pa.table({"url": [r["url"].replace(SERVER_PLACEHOLDER, server.base_url) for r in rows],
                             "caption": [r["caption"] for r in rows], "similarity": [0.3] * len(rows)}), path)


def _samples(run) -> dict[str, tuple[str, dict]]:
    """key -> (shard, members) over the line's shards."""
    from infra.tars import tar_samples

    out = {}
    for tar in sorted((run / "shard" / "shards").glob("*.tar")):
        for key, parts in tar_samples(tar):
            out[key] = (tar.name, parts)
    return out


def _digests(run) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((run / "shard" / "shards").glob("*.tar"))}


def test_removals_leave_the_line_only_where_they_were_and_never_come_back(tmp_path):
    from PIL import Image

    rows = synthetic_rows(tmp_path / "site", 60, 11)
    www = tmp_path / "site" / "www"
    urls, run = tmp_path / "urls", tmp_path / "run"
    urls.mkdir()
    with DemoServer(www) as server:
        config = _config(tmp_path, urls, server)
        _list(urls / "a.parquet", rows[:50], server)
        made = capline("run", config, "--run-dir", str(run), "--until", "shard", timeout=900)
        assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
        before, digests = _samples(run), _digests(run)
        assert len(digests) >= 4
        # four published samples in different shards, one for each kind of entry
        by_shard = {}
        for key, (shard, parts) in sorted(before.items()):
            by_shard.setdefault(shard, key)
        k_url, k_key, k_sha, k_img = list(by_shard.values())[:4]
        meta = {k: json.loads(before[k][1]["json"]) for k in (k_url, k_key, k_sha, k_img)}
        # the image entry: a re-encoded, resized copy of what was published
        img = Image.open(io.BytesIO(before[k_img][1]["jpg"])).convert("RGB")
        img.resize((img.width * 3 // 4, img.height * 3 // 4)).save(tmp_path / "takedown.png")
        (tmp_path / "takedown.txt").write_text(
            f"# a takedown request\n{meta[k_url]['url']}\nkey {k_key}\n{meta[k_sha]['sha256']}\ntakedown.png\n")
        out = capline("remove", str(run), "--list", str(tmp_path / "takedown.txt"), "--reason", "takedown request 7",
                      timeout=900)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-3000:]
        gone = {k_url, k_key, k_sha, k_img}
        after = _samples(run)
        assert gone.isdisjoint(after) and set(after) == set(before) - gone, text[-2000:]
        changed = {before[k][0] for k in gone}
        now = _digests(run)
        assert {n for n in digests if now[n] != digests[n]} == changed       # only the shards that held them
        # the old versions stay readable, byte for byte
        for name in changed:
            assert hashlib.sha256((run / "shard" / "line" / "versions" / "1" / name).read_bytes()).hexdigest() == digests[name]
        # what the users' readers read: webdataset, open_clip's sizes.json, and `capline verify`
        import webdataset as wds

        loaded = [s["__key__"] for s in wds.WebDataset(sorted(str(p) for p in (run / "shard" / "shards").glob("*.tar")),
                                                       shardshuffle=False)]
        assert sorted(loaded) == sorted(after)
        sizes = json.loads((run / "shard" / "shards" / "sizes.json").read_text())
        assert sum(sizes.values()) == len(after)
        verify = capline("verify", str(run))
        assert verify.returncode == 0 and "removal 1" in verify.stdout, verify.stdout + verify.stderr
        line = json.loads((run / "shard" / "line" / "line.json").read_text())
        (record,) = line["removals"]
        assert record["reason"] == "takedown request 7" and sorted(record["keys"]) == sorted(gone)
        assert sorted(record["shards"]) == sorted(changed) and record["entries"] == {"url": 1, "key": 1, "sha256": 1, "image": 1}
        card = (run / "shard" / "README.md").read_text()
        assert "## Removals" in card and "takedown request 7" in card
        status = capline("status", str(run))
        assert "removal 1" in status.stdout
        stage_rows = json.loads(capline("status", str(run), "--json").stdout)
        assert next(r for r in stage_rows if r["stage"] == "shard")["kept"] == len(after)   # not the pre-removal count
        told = capline("explain", str(run), k_key)
        assert told.returncode == 0 and "removed    removed (removal 1)" in told.stdout, told.stdout + told.stderr
        assert "takedown request 7" in told.stdout and f"{before[k_key][0]} rewritten without it" in told.stdout

        # the next append lists the removed URLs again (new captions: new keys), and a near copy of
        # the removed image under a URL never seen; none of them is published
        near = www / "img" / "near-copy.png"
        near.parent.mkdir(exist_ok=True)
        img.resize((img.width // 2, img.height // 2)).save(near)
        from PIL import ImageOps      # and in a coloured frame, as a page re-hosting it shows it

        ImageOps.expand(img, border=img.width // 10, fill=(200, 30, 30)).save(www / "img" / "framed-copy.png")
        again = [{"url": meta[k]["url"].replace(server.base_url, SERVER_PLACEHOLDER), "caption": "seen again " + k}
                 for k in gone]
        again.append({"url": f"{SERVER_PLACEHOLDER}/img/near-copy.png", "caption": "a near copy"})
        again.append({"url": f"{SERVER_PLACEHOLDER}/img/framed-copy.png", "caption": "a framed copy"})
        _list(urls / "b.parquet", rows[50:] + again, server)
        more = capline("run", config, "--run-dir", str(run), "--until", "shard", timeout=900)
        assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
        final = _samples(run)
        # the line still records the removal after its append (later runs keep applying it)
        assert [r["removal"] for r in json.loads((run / "shard" / "line" / "line.json").read_text())["removals"]] == [1]

        # the site opts out of two published images after the fact: the recheck removes those, no more
        urls_now = {k: json.loads(parts["json"])["url"] for k, (_, parts) in final.items()}
        out_keys = sorted(urls_now)[:2]
        paths = [urls_now[k].split(server.base_url, 1)[1] for k in out_keys]
        (www / "robots.txt").write_text("User-agent: *\n" + "".join(f"Disallow: {p}\n" for p in paths))
        rechecked = capline("recheck", str(run), timeout=900)
        assert rechecked.returncode == 0, rechecked.stdout[-3000:] + rechecked.stderr[-3000:]
        assert f"{len(final)} URLs on 1 hosts; 2 opt out now, removed as removal 2 (2 samples)" in rechecked.stdout
        assert rechecked.stdout.count("ray: starting") == 1      # the HEADs and the removal share one Ray
        # its progress counts URLs (it counted host buckets: "2/2 buckets" for the whole line)
        assert f"recheck: robots.txt and headers: {len(final)}/{len(final)} URLs" in rechecked.stdout, rechecked.stdout
        # by URL only: the line's lookup named the partitions to check, not every one the line holds
        checked = re.search(r"remove: the line's lookup names (\d+) partition\(s\) to check", rechecked.stdout)
        assert checked and 1 <= int(checked.group(1)) <= 2, rechecked.stdout[-2000:]
        report = json.loads(sorted((run / "shard" / "line" / "rechecks").glob("*.json"))[-1].read_text())
        assert sorted(report["urls"]) == sorted(urls_now[k] for k in out_keys) and report["unreachable"] == 0
        assert set(_samples(run)) == set(final) - set(out_keys)
    published_urls = {json.loads(parts["json"])["url"] for _, parts in final.values()}
    assert published_urls.isdisjoint(meta[k]["url"] for k in gone)
    assert f"{server.base_url}/img/near-copy.png" not in published_urls
    assert len(final) > len(after)                       # the append's other rows were published
    assert all(_digests(run)[n] == d for n, d in now.items()
               if n not in {final[k][0] for k in out_keys})      # and nothing else already there changed
    # each dropped by dedup as removed, saying which removal and how it matched
    from stages.base import read_ledger
    from stages.source.stage import sample_key

    ledger = read_ledger(run, "dedup", ["key", "reason", "detail"]).to_pylist()
    why = {r["key"]: (r["reason"], r["detail"]) for r in ledger}
    near_key = sample_key(f"{server.base_url}/img/near-copy.png", "a near copy")
    assert why[near_key][0] == "removed" and "near copy" in why[near_key][1], why.get(near_key)
    framed_key = sample_key(f"{server.base_url}/img/framed-copy.png", "a framed copy")
    assert why[framed_key][0] == "removed" and "near copy" in why[framed_key][1], why.get(framed_key)
    for k in gone:
        relisted = sample_key(meta[k]["url"], "seen again " + k)
        assert why[relisted][0] == "removed" and "removal 1" in why[relisted][1], why.get(relisted)
        assert why[k][0] == "removed"
