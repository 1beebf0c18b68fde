"""The runner's skip/resume logic and the in = kept + dropped invariant at scale: partitions written by
Ray tasks, checked from counts and key-set checksums alone. Small fake stages on a real local Ray."""
import json
import sys

import pyarrow as pa
import pytest
import ray.cloudpickle


from pipeline.config import load_config
from pipeline.runner import run_pipeline
from stages.base import DROPPED, KEPT, PartTask, Stage, StageResult
from stages.dataplane import add_sums, check_parts, keyset_sum, write_part
from infra.errors import UserError

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # Ray workers cannot import tests/


def _numbers(storage, part: str, start: int, stop: int) -> dict:
    keys = [f"k{i:04d}" for i in range(start, stop)]
    t = pa.table({"key": keys, "verdict": [KEPT] * len(keys), "reason": [""] * len(keys),
                  "caption": [f"caption {i}" for i in range(start, stop)]})
    return write_part(storage, "numbers", part, None, keys, t)


class Numbers(Stage):
    """A first stage: num_samples keys in partitions of 4, each written by its own Ray task."""
    name = "numbers"

    def __init__(self):
        self.calls = 0

    def section(self, config):
        return {"n": config.source.num_samples}

    def run(self, ctx):
        import ray

        self.calls += 1
        n = ctx.cfg["n"]
        task = ray.remote(num_cpus=0.25)(_numbers)
        parts = ray.get([task.remote(ctx.storage, f"p{i // 4}", i, min(n, i + 4)) for i in range(0, n, 4)])
        return StageResult(parts)


def drop_odd(table, lose: str | None = None, add: bool = False):
    keys = [k for k in table.column("key").to_pylist() if k != lose]
    if add and keys:
        keys.append("intruder")
    odd = [k != "intruder" and int(k[1:]) % 2 == 1 for k in keys]
    return pa.table({"key": keys, "verdict": [DROPPED if o else KEPT for o in odd],
                     "reason": ["odd" if o else "" for o in odd], "score": [1.0 if o else None for o in odd]}), {}


class DropOdd(Stage):
    name = "dropodd"
    preserve = ("reuse",)

    def __init__(self, lose=None, add=False, reuse=False):
        self.calls, self.lose, self.add, self.reuse = 0, lose, add, reuse

    def section(self, config):
        return {}

    def run(self, ctx):
        self.calls += 1
        if self.reuse:
            return StageResult(ctx.map_parts(drop_odd, num_cpus=0.25, reuse=True))
        tasks = [PartTask(u.part, u.file, u.part,
                          kwargs={"lose": self.lose, "add": self.add and u.part == "p1"}) for u in ctx.upstream]
        return StageResult(ctx.map_parts(drop_odd, tasks, num_cpus=0.25))


def _cfg(n=10):
    return load_config(None, [f"source.num_samples={n}"])


def _run(tmp_path, stages, **kw):
    return run_pipeline(_cfg(kw.pop("n", 10)), tmp_path, log=lambda m: None, stages=stages, observers=[], **kw)


@pytest.mark.slow   # a few seconds of training or many images: not in the fast set
def test_runs_then_skips_then_reruns_when_input_changes(tmp_path, ray_local, monkeypatch):
    from pipeline.executor import Executor

    warmed = []          # the shuffles' warm-up: started once a data stage runs, never for a run skipped whole
    real_warm = Executor.warm_shuffles
    monkeypatch.setattr(Executor, "warm_shuffles", lambda self, *a: warmed.append(1) or real_warm(self, *a))
    a, b = Numbers(), DropOdd()
    summary = _run(tmp_path, [a, b])
    assert len(warmed) == 1
    assert summary["dropodd"] == {**summary["dropodd"], "in": 10, "kept": 5, "dropped": {"odd": 5}, "partitions": 3}
    assert (tmp_path / "dropodd" / "_SUCCESS").is_file()
    assert sorted(p.name for p in (tmp_path / "dropodd" / "ledger").iterdir()) == ["p0.parquet", "p1.parquet", "p2.parquet"]
    _run(tmp_path, [a, b])
    assert (a.calls, b.calls) == (1, 1)          # same inputs: nothing redone
    assert len(warmed) == 1
    _run(tmp_path, [a, b], n=5)
    assert (a.calls, b.calls) == (2, 2)          # changed upstream: downstream redone too
    assert len(warmed) == 2
    assert sorted(p.name for p in (tmp_path / "dropodd" / "ledger").iterdir()) == ["p0.parquet", "p1.parquet"]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert set(manifest["stages"]) == {"numbers", "dropodd"}
    assert manifest["config"]["source"]["num_samples"] == 5
    # the manifest is sized by stages: counts and digests; the file lists stay in each _SUCCESS
    assert manifest["stages"]["dropodd"]["files"] == 2 and manifest["stages"]["dropodd"]["output_digest"]
    assert len(json.loads((tmp_path / "dropodd" / "_SUCCESS").read_text())["files"]) == 2
    from stages.base import read_ledger

    rows = read_ledger(tmp_path, "dropodd").to_pylist()
    assert [r["key"] for r in rows] == [f"k{i:04d}" for i in range(5)]
    assert rows[1]["caption"] == "caption 1"         # a stage's state travels with its verdicts


class FileSink(Stage):
    """A sink that writes one file: `text` (the tokenizer's shape, or a fixed one: the shard stage's)."""
    kind = "sink"

    def __init__(self, name: str, text: str):
        self.name, self.text, self.calls = name, text, 0

    def section(self, config):
        return {"text": self.text}

    def run(self, ctx):
        import hashlib

        self.calls += 1
        ctx.storage.write_bytes(f"{self.name}/out.txt", self.text.encode())
        return StageResult([], files={f"{self.name}/out.txt": hashlib.sha256(self.text.encode()).hexdigest()})


class Reader(Stage):
    """A sink that writes nothing of its own and reads the sinks before it (training's shape)."""
    name, kind = "reader", "sink"

    def __init__(self):
        self.calls = 0

    def section(self, config):
        return {}

    def run(self, ctx):
        self.calls += 1
        return StageResult([])


@pytest.mark.slow   # starts Ray: not in the fast set
def test_a_sink_that_changes_reruns_what_reads_it_even_when_the_sink_between_writes_the_same_bytes(tmp_path, ray_local):
    """The tokenizer, then the shard stage (whose shards do not depend on it), then training (which
    reads both): a new tokenizer with byte-identical shards retrained nothing, and trained on an old
    vocabulary. Training's input now holds every sink's output since the last judge."""
    from pipeline.inspect_run import status_rows
    import pipeline.inspect_run as inspect_run

    tok, shards, reader = FileSink("tok", "vocab A"), FileSink("shards", "same shards"), Reader()
    stages = [Numbers(), DropOdd(), tok, shards, reader]
    _run(tmp_path, stages)
    _run(tmp_path, stages)
    assert (tok.calls, shards.calls, reader.calls) == (1, 1, 1)             # nothing changed: nothing redone
    tok.text = "vocab B"
    _run(tmp_path, stages)
    assert (tok.calls, shards.calls, reader.calls) == (2, 2, 2)             # the reader ran on the new vocabulary
    marker = json.loads((tmp_path / "reader" / "_SUCCESS").read_text())
    assert marker["sink_digests"] == [json.loads((tmp_path / "tok" / "_SUCCESS").read_text())["output_digest"]]
    # `capline status` sees it too: with the tokenizer rerun alone the reader is stale
    tok.text = "vocab C"
    _run(tmp_path, stages, until="tok")
    ray_stages = inspect_run.STAGES
    try:
        inspect_run.STAGES = stages
        states = {r["stage"]: r["state"] for r in status_rows(tmp_path)}
    finally:
        inspect_run.STAGES = ray_stages
    assert states["tok"] == "done" and states["shards"] == "stale" and states["reader"] == "stale"


class TimedSink(FileSink):
    """A sink that takes `seconds` and says when it ran; `fail` raises once it has taken them."""

    def __init__(self, name: str, text: str, seconds: float, reads_sinks_before: bool = True):
        super().__init__(name, text)
        self.seconds, self.reads_sinks_before, self.fail, self.spans = seconds, reads_sinks_before, False, []

    def run(self, ctx):
        import time

        t0 = time.time()
        time.sleep(self.seconds)
        if self.fail:
            self.spans.append((t0, time.time()))
            raise RuntimeError(f"{self.name} broke")
        out = super().run(ctx)
        self.spans.append((t0, time.time()))
        return out


@pytest.mark.slow   # starts Ray: not in the fast set
def test_a_sink_that_reads_no_sink_before_it_runs_beside_that_sink(tmp_path, ray_local):
    """The shard stage reads the last judge's samples, never the tokenizer: it runs while the
    tokenizer trains, a new tokenizer leaves it done, and training (which reads both) reruns."""
    tok = TimedSink("tok", "vocab A", 2.0)
    shards = TimedSink("shards", "same shards", 2.0, reads_sinks_before=False)
    reader = Reader()
    stages = [Numbers(), DropOdd(), tok, shards, reader]
    _run(tmp_path, stages)
    (t0, t1), (s0, s1) = tok.spans[0], shards.spans[0]
    assert s0 < t1 and t0 < s1, (tok.spans, shards.spans)                 # the two ran at the same time
    assert reader.calls == 1
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {"tok", "shards", "reader"} <= set(manifest["stages"]) and "completed" in manifest
    tok.text = "vocab B"
    _run(tmp_path, stages)
    assert (tok.calls, shards.calls, reader.calls) == (2, 1, 2)           # shards untouched, the reader reran
    # a failure beside another stage: that stage finishes (its work kept), then the failure is said
    tok.text, tok.fail, shards.text = "vocab C", True, "new shards"
    with pytest.raises(RuntimeError, match="tok broke"):
        _run(tmp_path, stages)
    assert shards.calls == 2 and (tmp_path / "shards" / "_SUCCESS").exists() and reader.calls == 2
    tok.fail = False
    _run(tmp_path, stages)
    assert (tok.calls, shards.calls, reader.calls) == (3, 2, 3)           # the shards were not made again


@pytest.mark.slow   # starts Ray, a moto server or capline processes: not in the fast set
def test_a_lost_sample_fails_the_stage_naming_its_partition(tmp_path, ray_local):
    with pytest.raises(RuntimeError, match=r"stage dropodd, partition p1: 4 samples entered and 3 got a verdict"):
        _run(tmp_path, [Numbers(), DropOdd(lose="k0005")])
    assert not (tmp_path / "dropodd" / "_SUCCESS").exists()
    assert (tmp_path / "numbers" / "_SUCCESS").exists()


@pytest.mark.slow   # starts Ray, a moto server or capline processes: not in the fast set
def test_an_added_sample_fails_the_stage_naming_its_partition(tmp_path, ray_local):
    with pytest.raises(RuntimeError, match=r"stage dropodd, partition p1: 4 samples entered and 5 got a verdict"):
        _run(tmp_path, [Numbers(), DropOdd(add=True)])
    assert not (tmp_path / "dropodd" / "_SUCCESS").exists()


@pytest.mark.slow   # starts Ray, a moto server or capline processes: not in the fast set
def test_until_and_only(tmp_path, ray_local):
    a, b = Numbers(), DropOdd()
    with pytest.raises(UserError, match="has not finished"):
        _run(tmp_path, [a, b], only="dropodd")
    _run(tmp_path, [a, b], until="numbers")
    assert not (tmp_path / "dropodd").exists()
    _run(tmp_path, [a, b], only="dropodd")
    assert (a.calls, b.calls) == (1, 1)
    with pytest.raises(UserError, match="no such stage"):
        _run(tmp_path, [a, b], until="nope")


def _part(name, keys_in, kept, dropped, input_=None):
    from stages.dataplane import PartResult

    return PartResult(part=name, input=input_, n_in=len(keys_in), in_sum=str(keyset_sum(keys_in)),
                      kept=len(kept), kept_sum=str(keyset_sum(kept)), file=f"s/ledger/{name}.parquet", sha256="",
                      bytes=0, dropped={"x": len(dropped)} if dropped else {}, dropped_sum=str(keyset_sum(dropped)))


def test_a_part_result_is_parts_json_as_it_was():
    p = _part("u0", ["a", "b"], ["a"], ["b"], "u0")
    row = p.to_json()
    assert row["in"] == 2 and "n_in" not in row and set(row) == {"part", "file", "input", "sha256", "bytes", "in",
                                                                 "in_sum", "kept", "kept_sum", "dropped",
                                                                 "dropped_sum", "extra"}
    from stages.dataplane import PartResult

    assert PartResult.from_json(row) == p


def test_key_set_checksums_catch_what_counts_alone_miss():
    up = [_part("u0", ["a", "b"], ["a", "b"], []), _part("u1", ["c", "d"], ["c", "d"], [])]
    good = [_part("u0", ["a", "b"], ["a"], ["b"], "u0"), _part("u1", ["c", "d"], ["c", "d"], [], "u1")]
    assert check_parts("s", good, up) == {"in": 4, "kept": 3, "dropped": {"x": 1}}
    # the same counts, but partition u1 judged a sample that never came in place of one that did
    swapped = [good[0], _part("u1", ["c", "d"], ["c", "z"], [], "u1")]
    with pytest.raises(RuntimeError, match="partition u1: 2 samples entered and 2 got a verdict, and the key-set"):
        check_parts("s", swapped, up)
    # the stage read the wrong samples of upstream partition u1 (same count)
    misread = [good[0], _part("u1", ["c", "y"], ["c", "y"], [], "u1")]
    with pytest.raises(RuntimeError, match="upstream partition u1 kept 2 samples, but 2 entered .* differ"):
        check_parts("s", misread, up)
    # a whole upstream partition never processed
    with pytest.raises(RuntimeError, match="upstream partition u1 kept 2 samples, but 0 entered"):
        check_parts("s", good[:1], up)
    # a stage that repartitions (no single input per partition) is checked on the totals
    merged = [_part("m0", ["a", "b", "c"], ["a", "b", "c"], [])]
    with pytest.raises(RuntimeError, match="4 samples were kept upstream, 3 entered"):
        check_parts("s", merged, up)


def test_keyset_sum_is_order_independent_and_wraps():
    keys = [f"key{i}" for i in range(1000)]
    assert keyset_sum(keys) == keyset_sum(list(reversed(keys)))
    assert add_sums(keyset_sum(keys[:400]), keyset_sum(keys[400:])) == keyset_sum(keys)
    assert 0 <= keyset_sum(keys) < 2 ** 64
    assert keyset_sum(keys[:-1]) != keyset_sum(keys)


@pytest.mark.slow   # starts Ray, a moto server or capline processes: not in the fast set
def test_a_pure_stage_reuses_the_partitions_whose_input_did_not_change(tmp_path, ray_local):
    said = []
    run_pipeline(_cfg(10), tmp_path, log=said.append, stages=[Numbers(), DropOdd(reuse=True)], observers=[])
    assert not any("reused" in m for m in said)
    said.clear()
    # 12 samples: p0 and p1 hold what they held, p2 gains two
    grown = run_pipeline(_cfg(12), tmp_path, log=said.append, stages=[Numbers(), DropOdd(reuse=True)],
                         observers=[])
    assert "dropodd: 2 partitions unchanged since an earlier run, reused; 1 to compute" in said, said
    fresh = run_pipeline(_cfg(12), tmp_path / "fresh", log=lambda m: None, stages=[Numbers(), DropOdd()],
                         observers=[])
    assert grown["dropodd"]["kept"] == fresh["dropodd"]["kept"] == 6
    assert grown["dropodd"]["dropped"] == fresh["dropodd"]["dropped"]
    from stages.base import read_ledger

    assert read_ledger(tmp_path, "dropodd").sort_by("key").column("key").to_pylist() == [f"k{i:04d}" for i in range(12)]
    # a partition that no longer exists leaves no reusable copy behind
    run_pipeline(_cfg(4), tmp_path, log=lambda m: None, stages=[Numbers(), DropOdd(reuse=True)], observers=[])
    assert len(list((tmp_path / "dropodd" / "reuse").glob("[!_]*.parquet"))) == 1
    # ... and the summary the next run reads instead of each record names only that one
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "dropodd" / "reuse" / "_summary.parquet").num_rows == 1


def test_a_dead_end_names_the_reason_and_the_setting():
    from stages.ingest.stage import IngestStage
    from stages.registry import by_name

    ingest = IngestStage()
    assert ingest.dead_end({"in": 100, "kept": 95, "dropped": {"http_404": 5}}) is None
    most = ingest.dead_end({"in": 100, "kept": 5, "dropped": {"unsafe_url:private_address": 92, "http_404": 3}})
    assert most.startswith("ingest dropped 92 of 100 (92%) as unsafe_url:private_address")
    assert "stages.ingest.allow_hosts" in most
    # a filter stops the run only when it keeps nothing; 90 % dropped by a filter may be the intent
    language = by_name("language")
    assert language.dead_end({"in": 100, "kept": 5, "dropped": {"language": 95}}) is None
    assert language.dead_end({"in": 100, "kept": 0, "dropped": {"language": 100}}).startswith("language kept nothing")


@pytest.mark.slow   # starts Ray, a moto server or capline processes: not in the fast set
def test_workers_outlive_the_gap_between_two_stages(ray_local, tmp_path):
    """More workers than CPUs (fractional tasks), then a pause as between two stages: the next tasks
    run in the same processes, not in new ones that import torch again (Ray's default kills them
    after 1 s idle). Each batch waits at a barrier until all four tasks run at once, so a busy
    machine (one task done before the fourth process started) cannot make Ray reuse a process
    within a batch."""
    import os
    import time

    @ray_local.remote(num_cpus=0.5)
    def pid(barrier):
        os.makedirs(barrier, exist_ok=True)
        open(os.path.join(barrier, str(os.getpid())), "w").close()
        deadline = time.monotonic() + 120
        while len(os.listdir(barrier)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        return os.getpid()

    import psutil

    first = set(ray_local.get([pid.remote(str(tmp_path / "first")) for _ in range(4)]))
    time.sleep(4)
    before_second = time.time()
    second = set(ray_local.get([pid.remote(str(tmp_path / "second")) for _ in range(4)]))
    # every process of the second batch was already there (the shared cluster may hold idle workers
    # of earlier tests besides the first batch's, and Ray may pick any of them): none started anew
    assert len(first) == 4 and len(second) == 4, (first, second)
    assert all(psutil.Process(p).create_time() < before_second - 1 for p in second), (first, second)


@pytest.mark.slow   # starts Ray
def test_resuming_is_said_only_for_work_begun_on_the_same_input(tmp_path, ray_local):
    """A stage interrupted under one input and run again under another starts over, and says so:
    "resuming partial work" only where the same input began it."""
    import json

    _run(tmp_path, [Numbers(), DropOdd()], n=10)
    for stage in ("numbers", "dropodd"):          # as if interrupted: begun, never finished
        (tmp_path / stage / "_SUCCESS").unlink()
    said = []
    run_pipeline(_cfg(10), tmp_path, log=said.append, stages=[Numbers(), DropOdd()], observers=[])
    assert "numbers: running (resuming partial work)" in said, said
    (tmp_path / "dropodd" / "_SUCCESS").unlink()
    (tmp_path / "dropodd" / "_STARTED").write_text(json.dumps({"input_digest": "another input"}))
    said.clear()
    run_pipeline(_cfg(10), tmp_path, log=said.append, stages=[Numbers(), DropOdd()], observers=[])
    assert "dropodd: running" in said and "dropodd: running (resuming partial work)" not in said, said


def test_a_stage_started_over_is_wiped_from_one_listing_and_its_marker_goes_with_it(tmp_path):
    """On an object store each request waits out its latency: wiping a stage made from other inputs
    lists its folder once (files and folders together), keeps its content-addressed caches, and takes
    `_SUCCESS` with the rest (no separate delete after it)."""
    from infra.storage import Storage
    from pipeline.runner import Controls

    class Counting(Storage):
        asked: list = []

        def __getattribute__(self, name):
            if name in ("entries", "list", "list_dirs", "delete", "delete_files", "delete_all"):
                type(self).asked.append(name)
            return super().__getattribute__(name)

    inner = Storage.local(tmp_path / "bucket")
    storage = Counting(inner.fs, inner.root)
    for rel in ("s/_SUCCESS", "s/stats.json", "s/reuse/a.json", "s/old/x.parquet", "s/old/deep/y.parquet"):
        storage.write_bytes(rel, b"{}")
    controls = Controls(storage, tmp_path / "copy")
    assert controls.mirror
    Counting.asked.clear()
    controls.wipe("s", keep=("reuse",))
    controls.remove("s", "_SUCCESS", stored=False)
    assert [a for a in Counting.asked if a in ("entries", "list", "list_dirs")] == ["entries"]
    assert storage.list("s", recursive=True) == ["s/reuse/a.json"]
    assert storage.entries("s") == ([], ["reuse"])
    Counting.asked.clear()
    controls.remove("s", "_STARTED")       # a stage resumed: its marker alone, one batched delete
    assert Counting.asked == ["delete_files"]
    # the runner reads the listing beside the control files when the stage is to run again: the wipe
    # then lists nothing itself
    for rel in ("s/_SUCCESS", "s/_STARTED", "s/old/x.parquet"):
        storage.write_bytes(rel, b'{"input_digest": "before"}')
    Counting.asked.clear()
    marker, listed, started, entries = controls.read_all("s", ("_SUCCESS", "parts.json", "_STARTED"), listing=True)
    assert marker == started == {"input_digest": "before"} and listed is None
    assert entries == (["s/_STARTED", "s/_SUCCESS"], ["old", "reuse"])
    controls.wipe("s", keep=("reuse",), entries=entries)
    assert [a for a in Counting.asked if a in ("entries", "list", "list_dirs")] == ["entries"]
    assert storage.list("s", recursive=True) == ["s/reuse/a.json"]
