"""The executor (pipeline/executor.py) and the tar range reader (infra/tars.py): unit tests of their
logic, and the executor on a Ray cluster that declares many logical CPUs, running fake stages of
every kind through the runner."""
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import time

import pytest

from infra.errors import UserError
from infra.storage import Storage
from infra.tars import plan_spans, read_members
from pipeline.sizing import NodeShape, fit_request, in_flight, max_overlap, spans

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_spans_say_how_long_the_first_task_waited_and_how_long_tasks_took():
    assert spans([], 5.0) == {"at_once": 0}
    s = spans([(12.0, 13.0), (10.0, 14.0), (11.0, 11.5)], 4.0)
    assert s == {"at_once": 2, "first_start_s": 6.0, "task_s_median": 1.0, "task_s_max": 4.0}


def test_max_overlap_counts_tasks_running_at_one_instant():
    assert max_overlap([]) == 0
    assert max_overlap([(0, 1), (1, 2), (2, 3)]) == 1          # an end at t comes before a start at t
    assert max_overlap([(0, 10), (1, 2), (1.5, 3), (2.5, 4)]) == 3
    assert max_overlap([(0, 5)] * 16) == 16


def test_requests_fit_the_largest_node_and_in_flight_follows_the_cluster():
    one_cpu_nodes = NodeShape(cpus=4, largest_cpus=1, largest_gpus=0, nodes=4)
    assert fit_request(8, 0, one_cpu_nodes, "scorer") == 1      # never more than a node has: it would never run
    assert fit_request(0.5, 0, one_cpu_nodes, "x") == 0.5
    with pytest.raises(UserError, match=r"clip_score: .*1 GPU\(s\) and no node .* has any; set stages.clip_score.gpus_per_worker to 0"):
        fit_request(1, 1, one_cpu_nodes, "clip_score", "stages.clip_score.gpus_per_worker")
    big = NodeShape(cpus=3200, largest_cpus=32, largest_gpus=8, nodes=100)
    assert fit_request(1, 1, big, "x") == 1
    assert in_flight(1, big) >= 3200                           # every CPU of 100 nodes busy, not 2
    assert in_flight(0.5, NodeShape(cpus=16, largest_cpus=16, largest_gpus=0, nodes=1)) >= 32
    assert in_flight(1, NodeShape(cpus=2, largest_cpus=2, largest_gpus=0, nodes=1)) >= 2


def test_a_little_work_is_not_spread_over_a_new_worker_process_per_cpu():
    head = NodeShape(cpus=16, largest_cpus=16, largest_gpus=0, nodes=1)
    assert in_flight(1, head, [4] * 20, 64) == 2           # an append's 80 URLs: two processes, not 16
    assert in_flight(1, head, [4] * 20, None) == 32        # no per-worker size given: the CPUs decide
    assert in_flight(1, head, [4] * 2000, 64) == 32        # a fresh run's 8,000 URLs fill the cluster
    assert in_flight(1, head, [10_000] * 3, 64) == 32      # three big shards: as many as the CPUs allow
    assert in_flight(1, head, [0] * 5, 64) == 1            # nothing to fetch still runs its tasks


def test_spans_merge_neighbours_and_stop_at_gaps_and_size():
    offsets, sizes = [0, 100, 200, 10_000], [100, 100, 50, 10]
    assert plan_spans(offsets, sizes, max_gap=0) == [(0, 250, [0, 1, 2]), (10_000, 10_010, [3])]
    assert plan_spans(offsets, sizes, max_gap=20_000) == [(0, 10_010, [0, 1, 2, 3])]
    assert [s[2] for s in plan_spans(offsets, sizes, max_gap=20_000, max_span=200)] == [[0, 1], [2], [3]]
    assert plan_spans([300, 0], [10, 10], max_gap=1000) == [(0, 310, [1, 0])]     # by offset, any row order


def _tar(path, members: dict[str, bytes]) -> dict[str, tuple[int, int]]:
    """Write a tar; -> member -> (data offset, size)."""
    where = {}
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            where[m.name] = (m.offset_data, m.size)
    return where


def test_a_partition_of_images_is_one_request_per_tar(tmp_path):
    a = {f"{i:03d}.jpg": os.urandom(500 + i) for i in range(200)}
    b = {f"b{i:03d}.jpg": os.urandom(300) for i in range(50)}
    wa, wb = _tar(tmp_path / "a.tar", a), _tar(tmp_path / "b.tar", b)
    rows = [("a.tar", *wa[n], a[n]) for n in a] + [("b.tar", *wb[n], b[n]) for n in b] + [(None, None, None, None)]
    rows = rows[::-1]   # in no particular order, as a partition holds them
    counter = {}
    got = read_members(Storage.local(tmp_path), [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                       counter=counter)
    assert got == [r[3] for r in rows]
    assert counter["requests"] == 2                            # 250 images, two tars: two reads, not 250
    counter = {}
    scattered = read_members(Storage.local(tmp_path), ["a.tar", "a.tar"], [wa["000.jpg"][0], wa["199.jpg"][0]],
                             [wa["000.jpg"][1], wa["199.jpg"][1]], counter=counter, max_gap=1000)
    assert scattered == [a["000.jpg"], a["199.jpg"]] and counter["requests"] == 2   # far apart: no reading between


def test_many_tars_are_read_a_window_at_a_time_within_the_bytes_in_flight(tmp_path, monkeypatch):
    """read_members keeps TARS_AT_ONCE tars in flight, starting one as each finishes (no waves that
    wait for their slowest), and never more planned bytes than IN_FLIGHT_BYTES (one tar always)."""
    import threading
    import time

    import infra.tars as tars

    storage = Storage.local(tmp_path)
    for t in range(40):
        storage.write_bytes(f"{t:02d}.tar", bytes([t]) * 100)
    live, most, lock, finished = [0], [0], threading.Lock(), []

    class Slow:
        def read_ranges(self, rel, spans):
            with lock:
                live[0] += 1
                most[0] = max(most[0], live[0])
            time.sleep(0.02 if rel != "00.tar" else 1.0)     # one slow read: the others go on around it
            with lock:
                live[0] -= 1
                finished.append(rel)
            return storage.read_ranges(rel, spans)

    names = [f"{t:02d}.tar" for t in range(40)]
    got = read_members(Slow(), names, [10] * 40, [5] * 40)
    assert got == [bytes([t]) * 5 for t in range(40)]
    assert most[0] == tars.TARS_AT_ONCE and finished[-1] == "00.tar"     # 39 quick reads beside the slow one
    most[0] = 0
    monkeypatch.setattr(tars, "IN_FLIGHT_BYTES", 8)                # each tar's span (5 bytes) alone
    assert read_members(Slow(), names[1:6], [10] * 5, [5] * 5) == [bytes([t]) * 5 for t in range(1, 6)]
    assert most[0] == 1


CLUSTER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from infra import offline
    offline.apply()
    import pyarrow as pa
    import ray.cloudpickle
    from infra.ray_runtime import RayConfig, ray_session
    from pipeline.config import load_config
    from pipeline.runner import run_pipeline
    from stages.base import DROPPED, KEPT, Decide, Filter, Sink, Source, StageResult
    from stages.dataplane import keyset_sum, write_part

    def numbers(storage, part, start, stop):
        keys = [f"k{{i:05d}}" for i in range(start, stop)]
        t = pa.table({{"key": keys, "verdict": [KEPT] * len(keys), "reason": [""] * len(keys)}})
        return write_part(storage, "numbers", part, None, keys, t)

    class Numbers(Source):
        name = "numbers"
        def section(self, config):
            return {{"n": 640}}
        def run(self, ctx):
            return StageResult(ctx.run(numbers, [(ctx.storage, f"p{{i // 20:03d}}", i, i + 20) for i in range(0, 640, 20)],
                                       num_cpus=1))

    def slow_judge(table, cfg):
        time.sleep(0.4)
        keys = table.column("key").to_pylist()
        odd = [int(k[1:]) % 2 == 1 for k in keys]
        return pa.table({{"key": keys, "verdict": [DROPPED if o else KEPT for o in odd],
                         "reason": ["odd" if o else "" for o in odd]}}), {{}}

    class Odd(Filter):
        name = "odd"
        reasons = ("odd",)
        judge = staticmethod(slow_judge)
        def section(self, config):
            return {{}}
        def cpus(self, cfg):
            return 1.0

    def count_part(storage, file):
        time.sleep(0.4)
        t = storage.read_table(file)
        return t.num_rows

    def every_third(table, keep):
        keys = table.column("key").to_pylist()
        return pa.table({{"key": keys, "verdict": [KEPT if (int(k[1:]) // 2) % keep == 0 else DROPPED for k in keys],
                         "reason": ["" if (int(k[1:]) // 2) % keep == 0 else "thinned" for k in keys]}}), {{}}

    class Thin(Decide):
        name = "thin"
        def section(self, config):
            return {{}}
        def measure(self, ctx):
            return sum(ctx.run(count_part, [(ctx.storage, u.file) for u in ctx.upstream], num_cpus=1))
        def decide(self, ctx, total):
            return 3 if total > 100 else 1
        def apply(self, ctx, total, keep):
            return StageResult(ctx.map_parts(every_third, num_cpus=1, keep=keep))

    def read_all(storage, file):
        from stages.dataplane import read_kept
        keys = read_kept(storage, file, ["key"]).column("key").to_pylist()
        return len(keys), keyset_sum(keys)

    class Count(Sink):
        name = "count"
        lose = False
        def section(self, config):
            return {{"lose": self.lose}}
        def run(self, ctx):
            got = ctx.run(read_all, [(ctx.storage, u.file) for u in ctx.upstream], num_cpus=1)
            n = sum(g[0] for g in got) - (1 if self.lose else 0)
            from stages.dataplane import add_sums
            return StageResult([], {{"counted": n}}, consumed=(n, add_sums(*(g[1] for g in got))))

    def big_task():
        return "ran"

    class Big(Sink):
        name = "big"
        def section(self, config):
            return {{}}
        def run(self, ctx):
            return StageResult([], {{"big": ctx.call(big_task, num_cpus=64)}})

    def gpu_task():
        return "never"

    class Gpu(Sink):
        name = "gpu"
        def section(self, config):
            return {{}}
        def run(self, ctx):
            return StageResult([], {{"gpu": ctx.call(gpu_task, num_gpus=1, setting="stages.gpu.gpus")}})

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    out = {{}}
    with ray_session(RayConfig(num_cpus=16, object_store_memory_mb=256), log=lambda m: None):
        stages = [Numbers(), Odd(), Thin(), Count(), Big()]
        out["summary"] = run_pipeline(load_config(None, []), Path(sys.argv[1]), log=lambda m: None, stages=stages, observers=[])
        lost = Count(); lost.lose = True
        try:
            run_pipeline(load_config(None, []), Path(sys.argv[1]), log=lambda m: None, stages=[Numbers(), Odd(), Thin(), lost],
                         observers=[])
        except RuntimeError as err:
            out["lost"] = str(err)
        try:
            run_pipeline(load_config(None, []), Path(sys.argv[1]), log=lambda m: None, stages=[Numbers(), Gpu()], observers=[])
        except Exception as err:
            out["gpu"] = type(err).__name__ + ": " + str(err)
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow   # starts its own Ray cluster (16 logical CPUs) in a subprocess
def test_executor_fills_a_cluster_of_many_cpus_with_stages_of_every_kind(tmp_path):
    script = tmp_path / "cluster.py"
    script.write_text(CLUSTER_SCRIPT.format(root=ROOT))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(line[0][len("RESULT "):])
    s = out["summary"]
    assert s["numbers"]["kept"] == 640 and s["odd"]["kept"] == 320 and s["odd"]["dropped"] == {"odd": 320}
    assert s["thin"]["in"] == 320 and s["thin"]["dropped"] == {"thinned": 320 - s["thin"]["kept"]}
    assert s["count"] == {**s["count"], "in": s["thin"]["kept"], "counted": s["thin"]["kept"]}
    # 32 partitions of 0.4 s each on 16 declared CPUs: the executor keeps them all busy, not 2
    odd = [r for r in s["odd"]["tasks"] if r["tasks"] == 32][0]
    assert odd["cluster_cpus"] == 16 and odd["at_once"] >= 8, odd
    measure = [r for r in s["thin"]["tasks"] if r["tasks"] == 32][0]
    assert measure["at_once"] >= 8, measure
    assert s["big"]["big"] == "ran" and s["big"]["tasks"][0]["cpus_per_task"] == 16   # 64 asked, the node has 16
    assert not (tmp_path / "run" / "count" / "ledger").exists()                       # a sink writes no ledger
    n = s["thin"]["kept"]
    assert f"stage count: {n} samples were kept before it, it read {n - 1}" in out["lost"]
    assert out["gpu"].startswith("UserError: gpu: its tasks ask for 1 GPU(s) and no node of the cluster has any; "
                                 "set stages.gpu.gpus to 0")


def test_tar_samples_group_consecutive_members_and_refuse_what_is_not_a_plain_tar(tmp_path):
    import gzip

    from infra.tars import tar_samples

    _tar(tmp_path / "s.tar", {"a.jpg": b"A", "a.txt": b"cap a", "d/b.jpg": b"B", "d/b.json": b"{}"})
    assert list(tar_samples(tmp_path / "s.tar")) == [("a", {"jpg": b"A", "txt": b"cap a"}),
                                                      ("d/b", {"jpg": b"B", "json": b"{}"})]
    (tmp_path / "s.tar.gz").write_bytes(gzip.compress((tmp_path / "s.tar").read_bytes()))
    with pytest.raises(UserError, match=r"s.tar.gz: not an uncompressed tar .* decompress it first"):
        list(tar_samples(tmp_path / "s.tar.gz"))


def test_a_tar_member_with_a_negative_size_is_refused(tmp_path):
    """A member whose size is negative (base-256 encoded, as CVE-2025-8194's tars are) is refused in one
    line naming the member, not read."""
    from infra.tars import tar_samples

    _tar(tmp_path / "ok.tar", {"a.jpg": b"A" * 600, "a.txt": b"cap"})
    data = bytearray((tmp_path / "ok.tar").read_bytes())
    data[124:136] = b"\xff" * 12                      # size field: base-256, all ones = -1
    data[148:156] = b" " * 8                          # checksum over the header with spaces in its field
    data[148:156] = f"{sum(data[:512]):06o}\0 ".encode()
    (tmp_path / "bad.tar").write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"bad.tar: member 'a.jpg' has a negative size"):
        list(tar_samples(tmp_path / "bad.tar"))



def test_a_shuffles_pieces_travel_as_rows_and_come_back_to_their_reducer_in_map_order():
    """The rows Ray Data's hash shuffle moves (`shuffle_rows`): one per (map, bucket), an empty piece
    included, so every reducer runs and gets one piece per map; whatever order the shuffle delivers a
    bucket's rows in, its reducer gets them in map order. A reducer's exception travels as its
    answer; one that cannot be pickled still says what it was."""
    import random
    import threading

    import pyarrow as pa

    from pipeline.shuffle_rows import answer, pack_pieces, reduce_group, unpack_group

    maps = [[[1, 2], [], [3]], [pa.table({"x": [4]}), [5], []], [[], [], [6, 7]]]
    rows = pa.concat_tables([pack_pieces(m, pieces) for m, pieces in enumerate(maps)])
    assert rows.num_rows == 9 and rows.column("bucket").to_pylist() == [0, 1, 2] * 3
    for b in range(3):
        group = rows.filter(pa.compute.equal(rows.column("bucket"), b))
        shuffled = group.take(pa.array(random.Random(b).sample(range(3), 3)))
        bucket, pieces = unpack_group(shuffled)
        assert bucket == b and len(pieces) == 3
        for m in range(3):
            assert (pieces[m].equals(maps[m][b]) if isinstance(maps[m][b], pa.Table) else pieces[m] == maps[m][b])
    with pytest.raises(ValueError, match=r"rows of buckets \[0, 1\]"):
        unpack_group(rows.slice(0, 2))
    # a map's pieces are slices of one table: each travels with its own rows, not its parent's buffers
    big = pa.table({"h": pa.array(range(100_000), pa.uint64())})
    packed = pack_pieces(0, [big.slice(0, 10), big.slice(10)]).column("piece").to_pylist()
    assert len(packed[0]) < 2_000 and 800_000 < len(packed[1]) < 810_000
    assert unpack_group(pack_pieces(0, [big.slice(0, 10)]))[1][0].equals(big.slice(0, 10))

    class Unpicklable(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a} {b}")
            self.lock = threading.Lock()

    said = answer(2, 0.0, error=Unpicklable("disk", "gone")).to_pylist()[0]
    assert said["bucket"] == 2 and said["result"] is None
    import pickle

    err = pickle.loads(said["error"])
    assert isinstance(err, RuntimeError) and str(err) == "Unpicklable: disk gone"

    def cursed(n, *pieces):
        if n == 1:
            raise UserError("bucket one is cursed")
        return n, [len(p) for p in pieces]

    class Calls:      # what ray.put returned: a reference the reducer reads its calls from
        def hex(self):
            return "calls"

    import pipeline.shuffle_rows as shuffle_rows

    shuffle_rows._CALLS["calls"] = [(10,), (1,), (30,)]
    killed = []
    for b, expect in [(0, (10, [2, 1, 0])), (2, (30, [1, 0, 2]))]:
        group = rows.filter(pa.compute.equal(rows.column("bucket"), b))
        out = reduce_group(group, "t", cursed, Calls(), killed.append).to_pylist()[0]
        assert out["bucket"] == b and out["error"] is None and pickle.loads(out["result"]) == expect
    out = reduce_group(rows.filter(pa.compute.equal(rows.column("bucket"), 1)), "t", cursed, Calls(), killed.append)
    err = pickle.loads(out.to_pylist()[0]["error"])
    assert isinstance(err, UserError) and str(err) == "bucket one is cursed"
    assert killed == ["t (reduce)"] * 3      # the failpoint each reducer passes


def test_each_bucket_of_a_shuffle_has_a_route_that_ray_datas_partitioning_gives_a_partition_of_its_own():
    from ray.data._internal.arrow_ops.transform_pyarrow import hash_partition

    import pyarrow as pa

    from pipeline.shuffle_rows import routes

    for n in (1, 3, 8, 100):
        got = hash_partition(pa.table({"route": pa.array(routes(n), pa.int64())}), hash_cols=["route"], num_partitions=n)
        assert sorted(got) == list(range(n)) and all(t.num_rows == 1 for t in got.values())
    # grouped by the bucket number instead, 8 buckets share partitions: what routes are for
    plain = hash_partition(pa.table({"route": pa.array(range(8), pa.int64())}), hash_cols=["route"], num_partitions=8)
    assert len(plain) < 8


@pytest.mark.slow   # starts Ray
def test_a_shuffle_goes_through_the_object_store_each_reducer_getting_its_pieces_in_map_order(ray_local, monkeypatch):
    from pipeline.executor import Executor

    # defined here: Ray pickles them by value (a test module is not importable in the workers)
    def _split_by_parity(values, n):
        return [[v for v in values if v % n == b] for b in range(n)]

    def _gather(bucket, *pieces):
        return bucket, list(pieces)

    def _slow_gather(bucket, *pieces):      # long enough for two reducers to overlap where allowed
        import time

        time.sleep(0.5)
        return bucket, list(pieces)

    def _split_or_fail(values, n):
        if 13 in values:
            raise UserError("thirteen is not allowed here")
        return [[v for v in values if v % n == b] for b in range(n)]

    ex = Executor(log=lambda m: None)
    calls = [([1, 2, 3, 4],), ([5, 6],), ([],), ([7, 8, 9],)]
    out = ex.shuffle(lambda v: _split_by_parity(v, 3), calls, 3, _gather, [(b,) for b in range(3)], "parity")
    assert out == [(b, [[v for v in c[0] if v % 3 == b] for c in calls]) for b in range(3)]
    assert [r["what"] for r in ex.records[-2:]] == ["parity (map)", "parity"] and ex.records[-2]["tasks"] == 4
    # a little work: the maps are windowed (one at a time for 6 rows a worker), the reducers too (an
    # equal share of the 6 rows each), the pieces as before
    many = [([i, i + 1],) for i in range(0, 12, 2)]
    out = ex.shuffle(lambda v: _split_by_parity(v, 3), many, 3, _slow_gather, [(b,) for b in range(3)], "small",
                     sizes=[1] * len(many), items_per_worker=6)
    assert out == [(b, [[v for v in c[0] if v % 3 == b] for c in many]) for b in range(3)]
    assert ex.records[-2]["what"] == "small (map)" and ex.records[-2]["at_once"] == 1
    assert ex.records[-1]["what"] == "small" and ex.records[-1]["at_once"] == 1
    # unwindowed, each reducer is a partition of Ray Data's shuffle of its own (its route), and Ray
    # Data's reservations (half the cluster, in shares per operator) do not serialise them: on the
    # cluster's 2 CPUs at half a CPU each they overlap (Ray Data submits them a little apart, so
    # not always all three); and the dataset is built from the maps' own metadata, no task per map
    import ray.data

    monkeypatch.setattr(ray.data, "from_arrow_refs", lambda *a: pytest.fail("a metadata task per map"))
    out = ex.shuffle(lambda v: _split_by_parity(v, 3), many, 3, _slow_gather, [(b,) for b in range(3)], "wide",
                     num_cpus=0.5)
    assert out == [(b, [[v for v in c[0] if v % 3 == b] for c in many]) for b in range(3)]
    assert ex.records[-1]["what"] == "wide" and ex.records[-1]["at_once"] >= 2
    with pytest.raises(UserError, match=r"odd: map task 1: thirteen is not allowed here"):
        ex.shuffle(lambda v: _split_or_fail(v, 2), [([1],), ([13],)], 2, _gather, [(0,), (1,)], "odd")
    # reducers that answer nothing for a while: said, as `run` says a stall
    said = []
    slow = Executor(log=said.append, poll_seconds=0.2)
    out = slow.shuffle(lambda v: _split_by_parity(v, 2), calls, 2, _slow_gather, [(0,), (1,)], "slow")
    assert out == [(b, [[v for v in c[0] if v % 2 == b] for c in calls]) for b in range(2)]
    assert any(line.startswith("slow: 0/2 done, 2 running for") and "without finishing" in line for line in said), said
    # a window wider than the reducers is theirs, not Ray Data's to warn about ("The maximum number of
    # concurrent tasks ... is set to 2, but the operator only received 1 input(s)", on users' terminals)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ex.shuffle(lambda v: _split_by_parity(v, 1), many, 1, _gather, [(0,)], "one", sizes=[10] * len(many),
                         items_per_worker=1)
    assert out == [(0, [c[0] for c in many])]
    assert not [w for w in caught if "concurrent tasks" in str(w.message)], [str(w.message) for w in caught]
    # reducers that count their items (a recheck's URLs): the progress is in those, not in buckets
    def _counting(bucket, progress, *pieces):
        import time

        for piece in pieces:
            for _ in piece:
                time.sleep(0.8)
                progress.add.remote(1)
        return bucket

    import pipeline.task_window as task_window
    from infra.progress import Progress

    class Often(Progress):      # a line every 0.5 s, not every 10 s
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.every = 0.5

    monkeypatch.setattr(task_window, "Progress", Often)
    said.clear()
    counted = Executor(log=said.append)
    out = counted.shuffle(lambda v: _split_by_parity(v, 2), calls, 2, _counting, [(0,), (1,)], "counted",
                          items=9, item_unit="URLs")
    assert out == [0, 1]
    lines = [line for line in said if line.startswith("counted: ")]
    assert lines and all(" URLs" in line and "buckets" not in line for line in lines), said
    assert any(line.startswith("counted: 9/9 URLs") for line in lines), lines
    assert any(re.match(r"counted: [1-8]/9 URLs.*ETA", line) for line in lines), lines     # counted as they go
    # a reducer's exception is said in one line naming it; reducers stalled on a cluster whose
    # large node left (every node now smaller than their request) end in one line, not a wait
    def _fail_one(bucket, *pieces):
        if bucket == 1:
            raise UserError("bucket one is cursed")
        return bucket

    with pytest.raises(UserError, match=r"cursed: task 1: bucket one is cursed"):
        ex.shuffle(lambda v: _split_by_parity(v, 2), calls, 2, _fail_one, [(0,), (1,)], "cursed")
    from pipeline.sizing import NodeShape

    shapes = [NodeShape.now(), NodeShape(cpus=2.0, largest_cpus=0.25, largest_gpus=0.0, nodes=1)]
    monkeypatch.setattr(slow, "shape", lambda: shapes.pop(0) if len(shapes) > 1 else shapes[0])
    with pytest.raises(UserError, match=r"^shrunk: its tasks ask for 0.5 CPU\(s\) and no alive node has that much now"):
        slow.shuffle(lambda v: _split_by_parity(v, 2), calls, 2, _slow_gather, [(0,), (1,)], "shrunk", num_cpus=0.5)


@pytest.mark.slow   # starts Ray
@pytest.mark.timeout(240)
def test_a_task_or_reducer_that_kills_its_worker_every_time_is_tried_three_times_and_said_in_one_line(ray_local, tmp_path):
    """A task whose worker dies under it (the OOM killer on a heavy partition or bucket) runs 3 times
    and then ends the run in one error naming it and what probably killed it. A shuffle reducer's
    bound is capline's `max_retries=2`, which Ray Data 2.60 takes only through its deprecated
    `ray_remote_args` (without it, 4 tries; Ray Data's task pool for `map_batches` retries without
    end: benchmarks/pool_faults.py): a Ray where it no longer takes effect fails here."""
    import os
    import time

    from pipeline.executor import Executor

    starts = tmp_path / "starts"

    def _started() -> None:
        with open(starts, "a") as f:
            f.write("started\n")

    def _halves(values):
        return [[v for v in values if v % 2 == b] for b in range(2)]

    def _dies_on_one(bucket, *pieces):
        if bucket == 1:
            _started()
            os._exit(1)          # as the OOM killer ends a worker
        return bucket

    ex = Executor(log=lambda m: None)
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"^poisoned: a reducer \(its worker died 3 times running it: out of "
                                           r"memory\?\) failed: WorkerCrashedError"):
        ex.shuffle(_halves, [([1, 2],), ([3],)], 2, _dies_on_one, [(0,), (1,)], "poisoned")
    assert starts.read_text().count("started") == 3 and time.time() - t0 < 120
    starts.unlink()
    with pytest.raises(RuntimeError, match=r"^poisoned: partition 1 \(its worker died 3 times running it: out of "
                                           r"memory\?\) failed: WorkerCrashedError"):
        ex.run(_dies_on_one, [(0,), (1,), (2,)], "poisoned", describe=lambda c: f"partition {c[0]}")
    assert starts.read_text().count("started") == 3


def test_a_failed_task_is_said_by_what_killed_it():
    """The one line a failed task ends a run with: the input's fault as a UserError; a worker that
    died on every try (the kernel's OOM killer, a native crash) with its count and a hint at memory;
    Ray's memory monitor said as such (its own retries, not the task's count); any other exception
    named, without a hint."""
    from pipeline.task_results import task_error

    class WorkerCrashedError(Exception):        # Ray's, by name: what task_error looks at
        pass

    class OutOfMemoryError(Exception):
        pass

    said = lambda err, tries=3: str(task_error(err, "dedup describe", "partition 3", tries=tries))   # noqa: E731
    assert said(WorkerCrashedError("The worker died unexpectedly")) == (
        "dedup describe: partition 3 (its worker died 3 times running it: out of memory?) failed: "
        "WorkerCrashedError: The worker died unexpectedly")
    assert said(OutOfMemoryError("Task was killed due to the node running low on memory.")).startswith(
        "dedup describe: partition 3 (Ray killed its worker: the node ran out of memory) failed: OutOfMemoryError")
    assert said(ValueError("bad row")) == "dedup describe: partition 3 failed: ValueError: bad row"
    assert said(WorkerCrashedError("gone"), tries=None) == "dedup describe: partition 3 failed: WorkerCrashedError: gone"
    err = task_error(UserError("the list has no url column"), "source", "file a.csv", tries=3)
    assert isinstance(err, UserError) and str(err) == "source: file a.csv: the list has no url column"


class _Slots:
    """Slots for the task window whose calls finish in a given order, one each wait; `hold` waits
    come back empty first (a stall)."""

    def __init__(self, order, hold=0, fail_at=None):
        self.order, self.hold, self.fail_at = list(order), hold, fail_at
        self.closed = None

    def submit(self):
        pass

    def wait(self, timeout):
        if self.hold:
            self.hold -= 1
            time.sleep(timeout)
            return []
        return [self.order.pop(0)] if self.order else []

    def take(self, i):
        if i == self.fail_at:
            raise UserError(f"call {i}: refused")
        return [(i, 10.0 + i, 11.0 + i, f"result {i}")]

    def running(self):
        return len(self.order)

    def close(self, finished):
        self.closed = finished


def test_the_task_window_keeps_call_order_says_a_stall_and_closes_its_slots():
    from pipeline.task_window import drive

    said, stalls = [], []
    slots = _Slots([2, 0, 3, 1], hold=1)
    results, intervals = drive(slots, 4, "work", said.append, poll_seconds=0.05, on_stall=lambda: stalls.append(1),
                               close=slots.close)
    assert results == ["result 0", "result 1", "result 2", "result 3"]
    assert sorted(intervals) == [(10.0, 11.0), (11.0, 12.0), (12.0, 13.0), (13.0, 14.0)]
    assert stalls == [1] and any("running for" in m and "without finishing" in m for m in said), said
    assert slots.closed is True and said[-1].startswith("work: 4/4 partitions")

    failing = _Slots([0, 1, 2], fail_at=1)
    with pytest.raises(UserError, match="call 1: refused"):
        drive(failing, 3, "work", said.append, poll_seconds=0.05, close=failing.close)
    assert failing.closed is False          # the slots are told the calls did not all finish


@pytest.mark.slow   # seconds: kept out of the fast set (its 45 s budget)
def test_the_reducers_answers_are_read_in_a_thread_and_the_reading_stops_with_the_window():
    import threading

    from pipeline.ray_shuffle import ReducerSlots
    from pipeline.shuffle_rows import answer

    closed = threading.Event()

    class Answers:
        def __init__(self, batches, pause=0.0):
            self.batches, self.pause = batches, pause

        def iter_batches(self, **_):
            try:
                for b in self.batches:
                    time.sleep(self.pause)
                    if isinstance(b, Exception):
                        raise b
                    yield b
            finally:
                closed.set()

    slots = ReducerSlots(Answers([answer(1, 5.0, result="b1"), answer(0, 6.0, result="b0")], pause=0.3), "group", 2)
    assert slots.wait(0.05) == []                    # nothing within 0.05 s: the window can say so
    got = []
    while len(got) < 2:
        for batch in slots.wait(1):
            got += slots.take(batch)
    assert [(b, r) for b, _, _, r in got] == [(1, "b1"), (0, "b0")] and slots.running() == 0
    slots.close(True)
    assert closed.wait(2)

    closed.clear()
    slots = ReducerSlots(Answers([answer(0, 1.0, error=UserError("a bad row")), OSError("the node went away")]),
                         "group", 2)
    with pytest.raises(UserError, match="group: task 0: a bad row"):
        slots.take(slots.wait(2)[0])
    with pytest.raises(RuntimeError, match="group: reducers failed: OSError: the node went away"):
        slots.wait(2)
    slots.close(False)
    assert closed.wait(2)

    slots = ReducerSlots(Answers([answer(0, 1.0, result="only")]), "group", 2)
    slots.take(slots.wait(2)[0])
    with pytest.raises(RuntimeError, match="1 of 2 reducers gave no answer"):
        slots.wait(2)


def test_the_driver_makes_a_maps_block_metadata_as_ray_data_makes_it_of_the_table():
    from ray.data.block import BlockMetadataWithSchema

    from pipeline.ray_shuffle import _block_metadata
    from pipeline.shuffle_rows import pack_pieces

    for pieces in ([[1, 2], [], ["x" * 1000]], [None]):
        table = pack_pieces(3, pieces)
        assert _block_metadata(table.num_rows, table.nbytes) == BlockMetadataWithSchema.from_block(table)


@pytest.mark.slow   # starts Ray
def test_the_first_shuffles_workers_are_started_ahead_in_ray_datas_shuffle_environments(ray_local):
    import ray

    from pipeline.executor import Executor
    from pipeline.ray_shuffle import shuffle_worker_envs

    envs = shuffle_worker_envs()
    # Ray 2.60 runs its shuffle's map and reduce tasks each in a worker pool of their own
    assert len(envs) == 2 and all(env["env_vars"] for env in envs)
    started = []
    Executor(log=lambda m: None).warm_shuffles(started).join(timeout=60)
    assert ray.get(started, timeout=60) == [env["env_vars"] for env in envs]


@pytest.mark.slow   # starts Ray
def test_the_first_shuffle_beside_the_warm_up_thread_finds_ray_data_whole(tmp_path):
    """A fresh driver (Ray Data not yet imported) warms the shuffles and at once makes a map's block
    metadata and quiets Ray Data, as a command whose first stage shuffles at its start does (capline
    rebuild's ingest). Both threads import Ray Data: without one lock around those imports, the main
    thread read the warm thread's half-imported `ray.data` (AttributeError: module 'ray.data' has no
    attribute '_internal'; CI on bedb6a2). In a subprocess: the import happens once per process."""
    script = textwrap.dedent("""
        import sys
        from infra import offline
        offline.apply()
        import ray
        from infra.ray_runtime import RayConfig, ray_session
        from pipeline.executor import Executor
        from pipeline.ray_shuffle import _block_metadata, quiet_ray_data
        with ray_session(RayConfig(num_cpus=1, object_store_memory_mb=128), log=lambda m: None):
            assert "ray.data" not in sys.modules
            warm = Executor(log=lambda m: None).warm_shuffles()
            print("rows", _block_metadata(3, 100).num_rows)
            quiet_ray_data()
            warm.join(timeout=60)
        print("done")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0 and "rows 3" in out.stdout and "done" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


@pytest.mark.slow   # starts Ray
def test_what_a_result_stores_stays_in_the_object_store_and_the_driver_holds_a_reference(ray_local, tmp_path):
    """A task's result with stored data (`Stored`: write_part's keys) reaches the driver without
    it: the data is the task's second return, a reference the driver hands to later tasks. On a task and
    on a model's actor pool; a result without keys, or a plain value, arrives as it was."""
    import ray

    from infra.remote import Stored
    from pipeline.executor import Executor
    from stages.shared_model import SharedModel

    def _part(i):
        from types import SimpleNamespace

        import pyarrow as pa

        out = SimpleNamespace(part=f"p{i}", stored=None)
        if i % 2 == 0:
            out.stored = Stored(pa.table({"key": [f"k{i}-{j}" for j in range(1000)]}))
        return out

    ex = Executor(log=lambda m: None)
    for model in (None, SharedModel("no model", None, (), memory_mb=0)):
        out = ex.run(_part, [(i,) for i in range(4)], "parts", model=model)
        assert [o.part for o in out] == ["p0", "p1", "p2", "p3"]
        assert out[0].stored.data is None and isinstance(out[0].stored.handle(), ray.ObjectRef)
        assert out[1].stored is None
        assert ray.get(out[2].stored.handle()).column("key").to_pylist() == [f"k2-{j}" for j in range(1000)]
    assert ex.run(lambda x: {"x": x}, [(1,)], "plain") == [{"x": 1}]
