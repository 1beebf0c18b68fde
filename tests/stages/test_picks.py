"""The examples page's picks are made by the task that writes a partition's ledger, from the rows in
hand: the same rows a read of the ledger would pick, never in parts.json, and no task reads a
ledger to pick when every partition came with its picks."""
import pyarrow as pa

from stages.dataplane import KEPT, DROPPED, PartResult, write_part
from stages.examples import _pick_task, pick, stage_picks
from infra.storage import Storage


def _ledger(n: int, start: int = 0) -> pa.Table:
    keys = [f"k{i:03d}" for i in range(start, start + n)]
    return pa.table({"key": keys,
                     "verdict": [DROPPED if i % 3 == 0 else KEPT for i in range(start, start + n)],
                     "reason": ["lang" if i % 3 == 0 else "" for i in range(start, start + n)],
                     "score": [((i * 37) % 100) / 100 for i in range(start, start + n)],
                     "caption": [f"caption {i}" for i in range(start, start + n)]})


def test_picks_made_while_writing_are_those_a_read_of_the_ledger_makes(tmp_path):
    storage = Storage.local(tmp_path)
    t = _ledger(40)
    result = write_part(storage, "language", "p0", None, t.column("key").to_pylist(), t, pick=(5, 7, 0.5))
    assert result.picks["choice"] == [5, 7, 0.5]
    assert result.picks["groups"] == _pick_task(storage, result.file, 5, 7, 0.5)
    assert set(result.picks["groups"]) == {"kept", "lang"} and len(result.picks["groups"]["kept"]) == 5
    assert "picks" not in result.to_json() and PartResult.from_json(result.to_json()) == result
    plain = write_part(storage, "language", "p1", None, t.column("key").to_pylist(), t)
    assert getattr(plain, "picks", None) is None


class _Ctx:
    """What stage_picks needs of a StageContext; `run` records the tasks it was asked for."""
    def __init__(self, storage):
        self.storage, self.name, self.seed, self.asked, self.upstream = storage, "language", 7, [], None
        self.log = lambda m: None

    def run(self, fn, calls, what, **options):
        self.asked.extend(calls)
        return [fn(*c) for c in calls]


def test_stage_picks_read_no_ledger_for_partitions_that_came_with_picks(tmp_path):
    storage = Storage.local(tmp_path)
    parts = [write_part(storage, "language", f"p{i}", None, _ledger(30, 30 * i).column("key").to_pylist(),
                        _ledger(30, 30 * i), pick=(4, 7, 0.5)) for i in range(3)]
    ctx = _Ctx(storage)
    merged = stage_picks(ctx, parts, 4, 0.5)
    assert ctx.asked == []                                      # nothing read a ledger
    assert merged == pick(storage, [p.file for p in parts], 4, 7, 0.5)       # what reading every ledger picks
    # a later run finds them kept by partition: no task either, same picks
    again = _Ctx(storage)
    assert stage_picks(again, [PartResult.from_json(p.to_json()) for p in parts], 4, 0.5) == merged and again.asked == []
    # another choice (a new cut) cannot use them: the ledgers are read
    other = _Ctx(storage)
    stage_picks(other, parts, 4, 0.25)
    assert len(other.asked) == 3
