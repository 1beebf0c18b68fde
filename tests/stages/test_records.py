"""The per-partition records' summary: what reuse costs on the driver grows with what changed, not
with how many partitions the line holds."""
from infra.storage import Storage
from stages import records


class Counting:
    """A local Storage that counts the listings and reads the driver asks for."""

    def __init__(self, root):
        self.inner = Storage.local(root)
        self.listings, self.reads = 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def list(self, *a, **k):
        self.listings += 1
        return self.inner.list(*a, **k)

    def read_jsons(self, rels, default=None):
        self.reads += len(rels)
        return self.inner.read_jsons(rels, default)


def _line(tmp_path, n: int):
    s = Counting(tmp_path)
    recs = {f"reuse/p{i:05d}.json": {"part": i} for i in range(n)}
    for rel, r in recs.items():
        s.inner.write_json(rel, r)
    records.write_summary(s.inner, "reuse", recs)
    return s, recs


def test_a_few_new_records_are_read_directly_and_nothing_is_listed(tmp_path):
    s, recs = _line(tmp_path, 3000)
    for i in range(3000, 3030):                      # a 1 % append: 30 partitions done since the summary
        s.inner.write_json(f"reuse/p{i:05d}.json", {"part": i})
    wanted = {i: f"reuse/p{i:05d}.json" for i in range(3040)}     # and 10 nobody has computed
    previous = records.read_summary(s, "reuse")
    found = records.find(s, wanted, summaries={"reuse": previous})
    assert sorted(found) == list(range(3030)) and found[3010] == {"part": 3010}
    assert s.listings == 0 and s.reads == 40         # the 40 the summary lacks, no more
    used = set(wanted.values())
    assert records.stale_files(s, "reuse", used, previous) == [] and s.listings == 0


def test_many_lacking_or_no_summary_lists_the_folder_once(tmp_path):
    s, recs = _line(tmp_path, 20)
    for i in range(20, 200):
        s.inner.write_json(f"reuse/p{i:05d}.json", {"part": i})
    wanted = {i: f"reuse/p{i:05d}.json" for i in range(300)}
    found = records.find(s, wanted, summaries={"reuse": records.read_summary(s, "reuse")})
    assert sorted(found) == list(range(200))
    assert s.listings == 1 and s.reads == 180        # only those the listing showed
    s.listings = s.reads = 0
    (tmp_path / "reuse" / records.SUMMARY).unlink()
    assert len(records.find(s, wanted)) == 200 and s.listings == 1


def test_a_record_no_longer_used_makes_the_folder_listed_and_its_files_stale(tmp_path):
    s, recs = _line(tmp_path, 10)
    s.inner.write_bytes("reuse/p00003.parquet", b"x")
    previous = records.read_summary(s, "reuse")
    used = {rel for rel in recs if rel != "reuse/p00003.json"}
    stale = records.stale_files(s, "reuse", used, previous)
    assert sorted(stale) == ["reuse/p00003.json", "reuse/p00003.parquet"] and s.listings == 1


def test_one_reuse_mechanism_runs_only_what_no_earlier_run_did(tmp_path):
    """dataplane.reused_or_run, which map_parts(reuse=True) and dedup's steps share: an item whose
    key has a record is taken from it (decoded), the others run and are recorded (encoded), a None
    key always runs and leaves no record, and a key no item has any more is deleted with its files."""
    from types import SimpleNamespace

    from stages.dataplane import reused_or_run

    ran, said = [], []

    def task(storage, part, out):
        ran.append(part)
        if out:
            storage.write_bytes(f"{out}.parquet", b"data")
        return {"n": len(part)}

    storage = Counting(tmp_path)
    ctx = SimpleNamespace(storage=storage, name="s", log=said.append, upstream=None,
                          run=lambda fn, calls, what, **o: [fn(*c) for c in calls])

    def go(keys):
        items = [SimpleNamespace(part=p) for p in keys]
        return reused_or_run(ctx, task, "s/reuse", lambda u: keys[u.part], lambda u, out: (storage, u.part, out),
                             "s", "done before", "do", items=items, encode=lambda r: {**r, "encoded": True},
                             decode=lambda r: {"decoded": r["n"]})

    results, outs = go({"a": "ka", "bb": "kb", "c": None})
    assert ran == ["a", "bb", "c"] and results == [{"n": 1}, {"n": 2}, {"n": 1}]
    assert outs == {"a": "s/reuse/ka", "bb": "s/reuse/kb", "c": None}
    ran.clear()
    results, _ = go({"a": "ka", "bb": "kb2", "c": None})     # bb changed
    assert ran == ["bb", "c"]
    assert results == [{"decoded": 1}, {"n": 2}, {"n": 1}]
    assert said == ["s: 1 partitions done before, reused; 2 to do"]
    left = sorted(storage.inner.list("s/reuse", recursive=True))
    assert "s/reuse/kb.parquet" not in left and {"s/reuse/ka.parquet", "s/reuse/kb2.parquet"} <= set(left)
    assert not any("None" in f for f in left)


def test_reuse_sizes_the_task_window_by_the_rows_left_to_do(tmp_path):
    """A few small partitions left to compute run on the worker processes a run already has: the
    executor is told each task's rows (a PartResult's kept rows, a PartTask's slice or its upstream
    partition's), so it starts no process per CPU for them (pipeline/sizing.in_flight)."""
    from types import SimpleNamespace

    from pipeline.sizing import NodeShape, in_flight
    from stages.dataplane import ROWS_PER_WORKER, PartResult, PartTask, reused_or_run, rows_of

    def result(part, kept):
        return PartResult(part, f"up/{part}.parquet", None, "0" * 64, 1, kept, "0", kept, "0", {}, "0")

    upstream = [result(f"p{i}", 4) for i in range(20)]
    assert rows_of(upstream, None) == [4] * 20
    tasks = [PartTask("p0", "up/p0.parquet", "p0"), PartTask("p1", "up/p1.parquet", "p1", start=1),
             PartTask("p2", "up/p2.parquet", "p2", start=0, stop=3)]
    assert rows_of(tasks, upstream) == [4, 3, 3]
    assert rows_of([PartTask("p3", "s/scored/p3.parquet", "p3")], upstream) == [4]   # a file made from p3
    assert rows_of([PartTask("x", "elsewhere.parquet", "x")], upstream) is None    # not told: no bound

    asked = {}

    def run(fn, calls, what, **options):
        asked.update(options)
        return [fn(*c) for c in calls]

    storage = Storage.local(tmp_path)
    ctx = SimpleNamespace(storage=storage, name="s", log=lambda m: None, upstream=upstream, run=run)
    reused_or_run(ctx, lambda part, out: {"part": part}, "s/reuse", lambda u: u.part, lambda u, out: (u.part, out),
                  "s", "done before", "do")
    assert asked["sizes"] == [4] * 20 and asked["items_per_worker"] == ROWS_PER_WORKER
    head = NodeShape(cpus=16, largest_cpus=16, largest_gpus=0, nodes=1)
    assert in_flight(0.5, head, asked["sizes"], asked["items_per_worker"]) == 5         # not 64
    assert in_flight(0.5, head, [4] * 2000, asked["items_per_worker"]) == 64            # a fresh run: all
