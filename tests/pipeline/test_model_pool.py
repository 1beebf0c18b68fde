"""A model a stage's partitions share runs on an actor pool (Executor.run(model=...), Ray
actors): the model loads once per actor, the pool is as large as the nodes hold by the declared
memory, failures are named like a task's, a killed actor is replaced. Real Ray (2 CPUs)."""
import math
import os

import pytest

from infra.errors import UserError
from pipeline.executor import CALLS_PER_ACTOR, Executor, NodeShape, actors_that_fit
from stages.shared_model import SharedModel

GB = 2 ** 30


def test_actors_that_fit_count_each_node_by_cpus_gpus_and_memory():
    shape = NodeShape(cpus=40, largest_cpus=32, largest_gpus=1, nodes=2,
                      per_node=((32, 1, 64 * GB), (8, 0, 4 * GB)))
    assert actors_that_fit(1, 0, 0, shape) == 40
    assert actors_that_fit(1, 0, 3 * GB, shape) == 21 + 1        # memory bounds the big node, then the small one
    assert actors_that_fit(1, 1, 2 * GB, shape) == 1             # one GPU in the cluster: one copy
    assert actors_that_fit(0.5, 0, 5 * GB, shape) == 12           # the 4 GB node holds none
    assert actors_that_fit(16, 0, 0, shape) == 2                  # two half-full nodes never add up to one more


def _functions():
    """Defined in a function: Ray pickles them by value (a test module is not importable in the workers)."""
    def loader(folder):
        # every load leaves a file named by its process: how many copies were made, and where
        open(os.path.join(folder, f"load-{os.getpid()}"), "w").close()

    def work(folder, x):
        # the call runs in a process that loaded the model
        assert os.path.exists(os.path.join(folder, f"load-{os.getpid()}")), "called where the model was not loaded"
        if x == 13:
            raise UserError("thirteen is not allowed here")
        if x == 14:
            raise ValueError("fourteen broke")
        if x == 15 and not os.path.exists(os.path.join(folder, "killed")):
            open(os.path.join(folder, "killed"), "w").close()
            os.kill(os.getpid(), 9)          # as the OOM killer would, once
        if x == 17:
            os.kill(os.getpid(), 9)          # every time: a partition too big for any actor
        return x * x, os.getpid()
    return loader, work


_loader, _work = _functions()


@pytest.mark.slow   # Ray actors start in new worker processes: seconds each on 2 cores
def test_calls_on_a_model_pool_load_it_once_per_actor_and_return_in_order(ray_local, tmp_path):
    ex = Executor(log=lambda m: None)
    room = actors_that_fit(1, 0, 0, ex.shape())
    # declared memory that one node holds once: a pool of one actor, one load for 8 calls
    mem_mb = ex.shape().per_node[0][2] / 2 ** 20 * 0.6
    model = SharedModel("a test model", _loader, (str(tmp_path),), memory_mb=mem_mb)
    out = ex.run(_work, [(str(tmp_path), x) for x in range(8)], "squares", model=model)
    assert [o[0] for o in out] == [x * x for x in range(8)]
    loads = sorted(p.name for p in tmp_path.iterdir())
    assert len(loads) == 1 and {o[1] for o in out} == {int(loads[0].split("-")[1])}
    rec = ex.records[-1]
    assert rec["what"] == "squares" and rec["tasks"] == 8 and rec["actors"] == 1 and rec["model"] == "a test model"

    # with no memory declared the pool grows to the CPUs, never past them, and starts an actor for
    # CALLS_PER_ACTOR calls at least (a start is a new process): loads <= actors
    for n in (3, 40):
        small = tmp_path / f"small{n}"
        small.mkdir()
        xs = range(20, 20 + n)                  # none of the values _work fails on
        out = ex.run(_work, [(str(small), x) for x in xs], "squares", model=SharedModel("m", _loader, (str(small),)))
        assert [o[0] for o in out] == [x * x for x in xs]
        expected = min(room, math.ceil(n / CALLS_PER_ACTOR))
        assert ex.records[-1]["actors"] == expected and len(list(small.iterdir())) <= expected


@pytest.mark.slow
def test_a_failing_call_or_model_is_said_in_one_line_naming_it(ray_local, tmp_path):
    ex = Executor(log=lambda m: None)
    model = SharedModel("a test model", _loader, (str(tmp_path),))
    label = lambda c: f"partition p{c[1]}"   # noqa: E731
    with pytest.raises(UserError, match=r"^odd: partition p13: thirteen is not allowed here$"):
        ex.run(_work, [(str(tmp_path), x) for x in (1, 13, 3)], "odd", model=model, describe=label)
    with pytest.raises(RuntimeError, match=r"^odd: partition p14 failed: ValueError: fourteen broke$"):
        ex.run(_work, [(str(tmp_path), x) for x in (1, 14)], "odd", model=model, describe=label)
    with pytest.raises(RuntimeError, match=r"^odd: partition p17 \(its actor died 3 times running it: out of memory\?\) failed: "):
        ex.run(_work, [(str(tmp_path), x) for x in (1, 17)], "odd", model=model, describe=label)
    missing = SharedModel("a missing model", _loader, (str(tmp_path / "nowhere"),))
    with pytest.raises(RuntimeError, match=r"^odd: loading a missing model failed: .*nowhere"):
        ex.run(_work, [(str(tmp_path), 1)], "odd", model=missing)
    huge = SharedModel("a huge model", _loader, (str(tmp_path),), memory_mb=10 ** 9, setting="stages.x.model")
    with pytest.raises(UserError, match=r"one copy of a huge model asks for .* change stages.x.model or add a larger node"):
        ex.run(_work, [(str(tmp_path), 1)], "odd", model=huge)


@pytest.mark.slow
def test_an_actor_killed_mid_call_is_restarted_with_its_model_and_the_call_runs_again(ray_local, tmp_path):
    ex = Executor(log=lambda m: None)
    model = SharedModel("a test model", _loader, (str(tmp_path),), memory_mb=ex.shape().per_node[0][2] / 2 ** 20 * 0.6)
    out = ex.run(_work, [(str(tmp_path), x) for x in (15, 16)], "kill", model=model)
    assert [o[0] for o in out] == [225, 256]
    assert (tmp_path / "killed").exists()
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("load-")]) == 2    # loaded again after the kill
