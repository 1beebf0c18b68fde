"""Incremental runs: partition A, then A+B, holds the same samples as one run on A+B, and the
second run does not download A again."""
import json

import pytest

from stages.base import read_ledger

from pipeline.config import load_config
from pipeline.runner import run_pipeline
from pipeline.verify import sample_digests
from stages.source.demo_server import DemoServer
from stages.source.synthetic import SERVER_PLACEHOLDER
from helpers import synthetic_rows

pytestmark = pytest.mark.slow


def _write_partition(path, rows, base):
    lines = ["url,caption"] + [f"{r['url'].replace(SERVER_PLACEHOLDER, base)},\"{r['caption']}\"" for r in rows]
    path.write_text("\n".join(lines) + "\n")


def test_appending_a_partition(tmp_path, ray_local):
    # some drops and duplicates across partitions
    rows = synthetic_rows(tmp_path / "site", 240, 5, http_404=0.05, train_near_copy=0.05)
    with DemoServer(tmp_path / "site" / "www") as server:
        def cfg(folder, *extra):
            return load_config(None, [*extra, 
                "source.kind=urls", f"source.path={folder}", f"stages.ingest.allow_hosts=['{server.netloc}']",
                "stages.ingest.samples_per_shard=50", "stages.ingest.compact_rows=50", "stages.tokenizer.vocab_size=400",
                f"stages.dedup.cache_dir={tmp_path / 'cache'}", "stages.shard.samples_per_shard=60",
                "stages.dedup.eval_sets=[{name: digits, kind: builtin, path: digits}]", "train.steps=0",
                "stages.clip_score.bootstrap.steps=20"])

        inc, one = tmp_path / "inc_urls", tmp_path / "one_urls"
        inc.mkdir()
        one.mkdir()
        _write_partition(inc / "a.csv", rows[:150], server.base_url)
        run_pipeline(cfg(inc), tmp_path / "inc", log=lambda m: None)
        (part_a,) = (p for p in (tmp_path / "inc" / "ingest" / "parts").iterdir() if p.is_dir())   # beside: _summary.parquet
        stamp = sorted(p.stat().st_mtime_ns for p in (part_a / "shards").glob("*.tar"))
        _write_partition(inc / "b.csv", rows[150:], server.base_url)
        logs = []
        run_pipeline(cfg(inc), tmp_path / "inc", log=logs.append)
        assert any("ingest: 3 shards downloaded before, reused; 2 to download" in m for m in logs), logs
        # dedup describes only the new partitions; pairs across old and new are still found (below)
        assert any("dedup: 3 partitions described before with the same input, reused; 2 to describe" in m
                   for m in logs), logs
        # ... signs them in the same tasks (no sign task) ...
        assert any(m.startswith("dedup: 3 partitions signed before") and m.endswith("reused; 0 to sign") for m in logs), logs
        # ... and searches pairs only in the groups the new partitions touch, carrying the line's edges
        assert any("dedup: 3 partitions' pairs carried from the dataset line's edges; searching the groups of 2 new"
                   in m for m in logs), logs
        assert sorted(p.stat().st_mtime_ns for p in (part_a / "shards").glob("*.tar")) == stamp
        # the line's signatures in chunks (the append read the first run's and kept its own as one)
        line = json.loads((tmp_path / "inc" / "dedup" / "edges" / "line.json").read_text())
        assert sorted(p for c in line["chunks"].values() for p in c["parts"]) == sorted(line["signed"])
        assert sorted(f"dedup/edges/sigs/{f.name}" for f in (tmp_path / "inc" / "dedup" / "edges" / "sigs").iterdir()) \
            == sorted(line["chunks"])
        _write_partition(one / "a.csv", rows[:150], server.base_url)
        _write_partition(one / "b.csv", rows[150:], server.base_url)
        # the single run cuts its partitions into map slices of 64 KiB of images and lets each reducer
        # write several shards (as a run with many partitions would): the same shards, byte for byte
        grouped = []
        run_pipeline(cfg(one, "stages.shard.map_bytes=65536", "stages.shard.shuffle_pieces=4"), tmp_path / "one",
                     log=grouped.append)
    assert any("each reducer writes" in m and "consecutive shards" in m for m in grouped), grouped
    a, b = sample_digests(tmp_path / "inc"), sample_digests(tmp_path / "one")
    assert len(a) > 150
    assert a == b
    shards = lambda run: json.loads((run / "shard" / "shards.json").read_text())   # noqa: E731
    assert shards(tmp_path / "inc") == shards(tmp_path / "one")
    dedup = read_ledger(tmp_path / "inc", "dedup").to_pylist()
    assert any(r["reason"] == "near_duplicate" for r in dedup)   # duplicates across partitions found
    # the append's dedup verdicts are those of one run over both lists
    verdicts = lambda run: sorted((r["key"], r["verdict"], r["reason"], r["detail"])   # noqa: E731
                                  for r in read_ledger(run, "dedup").to_pylist())
    assert verdicts(tmp_path / "inc") == verdicts(tmp_path / "one")


def _line_config(urls, server, *more: str):
    """A small line over the URL files in `urls` that keeps its bootstrap scorer."""
    return load_config(None, [
        "source.kind=urls", f"source.path={urls}", f"stages.ingest.allow_hosts=['{server.netloc}']",
        "stages.ingest.samples_per_shard=40", "stages.ingest.compact_rows=40", "stages.dedup.eval_sets=[]",
        "stages.clip_score.bootstrap.reuse=true", *more])


def test_a_dataset_line_keeps_its_scorer_and_scores_what_it_added(tmp_path, ray_local):
    """bootstrap.reuse and tokenizer.reuse: the second (scheduled) run trains neither the scorer nor
    the tokenizer again, and does not score the partitions it scored before; the old samples keep
    their scores."""
    rows = synthetic_rows(tmp_path / "site", 160, 5, mismatched_caption=0.2)
    urls = tmp_path / "urls"
    urls.mkdir()
    with DemoServer(tmp_path / "site" / "www") as server:
        cfg = _line_config(urls, server, "stages.clip_score.bootstrap.steps=10", "stages.tokenizer.vocab_size=400",
                           "stages.tokenizer.reuse=true")
        _write_partition(urls / "a.csv", rows[:120], server.base_url)
        run_pipeline(cfg, tmp_path / "run", until="tokenizer", log=lambda m: None)
        model = (tmp_path / "run" / "tokenizer" / "spm.model").read_bytes()
        before = {r["key"]: (r["verdict"], r["score"]) for r in read_ledger(tmp_path / "run", "clip_score").to_pylist()}
        _write_partition(urls / "b.csv", rows[120:], server.base_url)
        logs = []
        run_pipeline(cfg, tmp_path / "run", until="tokenizer", log=logs.append)
    assert any("the bootstrap scorer of this dataset line" in m for m in logs), logs
    assert not any("training the bootstrap scorer" in m for m in logs), logs
    assert any(m.startswith("clip_score: 3 partitions scored before by scorer") and m.endswith("reused; 1 to score")
               for m in logs), logs
    after = {r["key"]: r["score"] for r in read_ledger(tmp_path / "run", "clip_score").to_pylist()}
    assert len(after) > len(before) and all(after[k] == s for k, (_, s) in before.items())
    # the tokenizer: the line's model, byte for byte, and the stage still counted every sample it read
    assert any(m.startswith("tokenizer: the model of this dataset line") for m in logs), logs
    assert (tmp_path / "run" / "tokenizer" / "spm.model").read_bytes() == model


def test_an_append_only_line_adds_shards_and_never_changes_published_ones(tmp_path, ray_local):
    """stages.shard.append: the second run writes only new shards, numbered after the first run's
    (though the tokenizer before it, the line's, wrote the same bytes),
    which stay byte for byte; the manifest names what it added; a new copy of a published sample is
    the duplicate even when its key is the smaller; a change that would drop a published sample is
    refused with the setting to change."""
    import hashlib

    from infra.errors import UserError
    from stages.source.stage import sample_key

    rows = synthetic_rows(tmp_path / "site", 200, 5, http_404=0.05, train_near_copy=0.05)
    urls = tmp_path / "urls"
    urls.mkdir()
    run = tmp_path / "run"
    with DemoServer(tmp_path / "site" / "www") as server:
        def cfg(*extra):
            return load_config(None, [
                "source.kind=urls", f"source.path={urls}", f"stages.ingest.allow_hosts=['{server.netloc}']",
                "stages.ingest.samples_per_shard=50", "stages.ingest.compact_rows=50", "stages.tokenizer.vocab_size=400",
                "stages.dedup.eval_sets=[]", "stages.shard.samples_per_shard=40", "stages.shard.append=true",
                "stages.clip_score.reuse_cut=true", "stages.clip_score.bootstrap.reuse=true", "stages.tokenizer.reuse=true",
                "stages.clip_score.bootstrap.steps=10", "stages.clip_score.keep_fraction=0.9", "train.steps=0", *extra])

        _write_partition(urls / "a.csv", rows[:120], server.base_url)
        run_pipeline(cfg(), run, until="shard", log=lambda m: None)
        first = json.loads((run / "shard" / "shards.json").read_text())
        first_record = (run / "shard" / "line" / "line.json").read_bytes()
        tars = {s["name"]: hashlib.sha256((run / "shard" / "shards" / s["name"]).read_bytes()).hexdigest()
                for s in first}
        published = {r["key"]: r["tar"] for r in read_ledger(run, "shard").to_pylist()}
        # new rows: the rest, and copies of a published sample (same image, other captions): a copy whose
        # key sorts before the published one would be kept by the smallest-key rule alone
        key_of = lambda r: sample_key(r["url"].replace(SERVER_PLACEHOLDER, server.base_url), r["caption"])  # noqa: E731
        target = max((r for r in rows[:120] if key_of(r) in published), key=key_of)   # keys vary with the port
        copies = [{**target, "caption": f"{target['caption']} copy {i}"} for i in range(8)]
        _write_partition(urls / "b.csv", rows[120:] + copies, server.base_url)
        logs = []
        run_pipeline(cfg(), run, until="shard", log=logs.append)
        second = json.loads((run / "shard" / "shards.json").read_text())
        target_key = key_of(target)
        assert any(key_of(c) < target_key for c in copies)
        assert any("the dataset line's cut" in m for m in logs), logs
        # what the first run did for partition a is not redone: its verdicts, examples and placement
        assert any(m.startswith("shard: 3 partitions keep what this dataset line published") for m in logs), logs
        assert any(m.startswith("dedup: 3 partitions unchanged since an earlier run, reused") for m in logs), logs
        assert any(m.startswith("clip_score: 3 partitions unchanged since an earlier run, reused") for m in logs), logs
        stats = json.loads((run / "basic" / "stats.json").read_text())
        # examples: the 3 earlier partitions' picks kept from the first run, the new ones picked by the
        # tasks that judged them: no task reads a ledger to pick
        assert not [t for t in stats["tasks"] if t["what"] == "examples"], stats["tasks"]
        assert json.loads((run / "basic" / "picks.json").read_text())["kept"]
        assert second[:len(first)] == first
        assert {s["name"]: hashlib.sha256((run / "shard" / "shards" / s["name"]).read_bytes()).hexdigest()
                for s in first} == tars
        added = [s["name"] for s in second[len(first):]]
        assert added and added[0] == f"{len(first):06d}.tar"
        manifest = json.loads((run / "manifest.json").read_text())
        assert manifest["artifacts"]["shard"]["added"] == added
        line = json.loads((run / "shard" / "line" / "line.json").read_text())
        assert [r["added"] for r in line["runs"]] == [[s["name"] for s in first], added]
        # every kept sample in exactly one shard; the published ones where they were
        ledger = {r["key"]: r["tar"] for r in read_ledger(run, "shard").to_pylist()}
        kept = {r["key"] for r in read_ledger(run, "clip_score").to_pylist() if r["verdict"] == "kept"}
        assert set(ledger) == kept
        assert all(ledger[k] == t for k, t in published.items())
        dedup = {r["key"]: r for r in read_ledger(run, "dedup").to_pylist()}
        for c in copies:
            row = dedup[key_of(c)]
            assert (row["verdict"], row["match_key"]) == ("dropped", target_key), row
        # a stale line.json (the first run's, restored from a backup) would number new shards over the
        # second run's published ones: refused, naming the shards, before anything is written
        record = run / "shard" / "line" / "line.json"
        now_record = record.read_bytes()
        record.write_bytes(first_record)
        _write_partition(urls / "c.csv", [{**target, "caption": f"{target['caption']} again"}], server.base_url)
        with pytest.raises(UserError, match=rf"does not list shard\(s\) {added[0]}.* stale or not this line's"):
            run_pipeline(cfg(), run, until="shard", log=lambda m: None)
        assert {s["name"]: hashlib.sha256((run / "shard" / "shards" / s["name"]).read_bytes()).hexdigest()
                for s in first} == tars
        # the same record with only its last shard left out (its runs whole): refused too, where the
        # append used to write its new samples into that shard's name over published ones
        clipped = json.loads(now_record)
        last = clipped["shards"].pop()["name"]
        record.write_text(json.dumps(clipped))
        before = (run / "shard" / "shards" / last).read_bytes()
        with pytest.raises(UserError, match=rf"does not list shard\(s\) {last}.* nothing was written"):
            run_pipeline(cfg(), run, until="shard", log=lambda m: None)
        assert (run / "shard" / "shards" / last).read_bytes() == before
        record.write_bytes(now_record)
        (urls / "c.csv").unlink()
        # a change that would drop published samples is refused, naming the settings; nothing published moves
        with pytest.raises(UserError, match=r"stages.shard.append: \d+ sample\(s\) published by earlier runs"):
            run_pipeline(cfg("stages.basic.min_words=6"), run, until="shard", log=lambda m: None)
        # so is one that lost a URL file the line published from
        (urls / "a.csv").unlink()
        with pytest.raises(UserError, match=r"stages.shard.append: 3 input partition\(s\) that earlier runs"):
            run_pipeline(cfg(), run, until="shard", log=lambda m: None)
    assert json.loads((run / "shard" / "line" / "line.json").read_text()) == line


@pytest.mark.slow
def test_a_dataset_line_with_the_bootstrap_scorer_keeps_new_samples_at_the_lines_rate(tmp_path, ray_local):
    """A line's bootstrap scorer had memorised its first run's pairs (~0.9 against ~0.4 for unseen
    ones) and its frozen cut kept 1 of ~50 new samples, silently. Cross-fitted, no pair is scored by
    a model that trained on it: the append keeps its new samples at about the first run's rate."""
    rows = synthetic_rows(tmp_path / "site", 220, 5, mismatched_caption=0.2)
    urls = tmp_path / "urls"
    urls.mkdir()
    with DemoServer(tmp_path / "site" / "www") as server:
        cfg = _line_config(urls, server, "stages.clip_score.bootstrap.steps=100", "stages.clip_score.reuse_cut=true",
                           "stages.clip_score.keep_fraction=0.5")
        _write_partition(urls / "a.csv", rows[:160], server.base_url)
        run_pipeline(cfg, tmp_path / "run", until="clip_score", log=lambda m: None)
        first = {r["key"]: r["verdict"] for r in read_ledger(tmp_path / "run", "clip_score").to_pylist()}
        _write_partition(urls / "b.csv", rows[160:], server.base_url)
        logs = []
        run_pipeline(cfg, tmp_path / "run", until="clip_score", log=logs.append)
    assert any("the bootstrap scorer of this dataset line" in m for m in logs), logs
    new = [r for r in read_ledger(tmp_path / "run", "clip_score").to_pylist() if r["key"] not in first]
    rate = sum(r["verdict"] == "kept" for r in new) / len(new)
    first_rate = sum(v == "kept" for v in first.values()) / len(first)
    assert len(new) >= 40 and rate >= first_rate / 2, (rate, first_rate, len(new))
    assert not any("scores have shifted" in m for m in logs), logs


def test_a_lines_cut_that_keeps_far_fewer_new_samples_is_said_with_the_shift():
    from collections import Counter

    from stages.filters.clip_score import line_shift

    kept_cut = {"cut": 900, "n": 100}
    old = Counter({950: 50, 100: 50})                     # the line: half above its cut
    assert line_shift(old + Counter({950: 25, 100: 25}), 150, kept_cut, 0.5) is None
    said = line_shift(old + Counter({950: 1, 100: 49}), 150, kept_cut, 0.5)
    assert said and "keeps about 2% of the 50 samples added" in said and "kept 50%" in said
    assert line_shift(old + Counter({100: 10}), 110, kept_cut, 0.5) is None   # too few added to tell
