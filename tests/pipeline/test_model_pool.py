"""A model a stage's partitions share runs on an actor pool (Executor.run(model=...), Ray
actors): the model loads once per actor, the pool is as large as the nodes hold by the declared
memory, failures are named like a task's, a killed actor is replaced. Real Ray (2 CPUs)."""
import math
import os
import random

import pytest

from infra.errors import UserError
from pipeline.executor import Executor
from pipeline.model_pool import CALLS_PER_ACTOR, PoolQueue
from pipeline.sizing import NodeShape, actors_that_fit
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


def test_a_call_that_died_beside_others_runs_again_alone_and_only_deaths_alone_blame_it():
    q = PoolQueue(n_calls=2, n_actors=1)
    assert [q.next_for(0), q.next_for(0), q.next_for(0)] == [0, 1, None]     # two queued, then full
    # call 1 kills the actor; call 0 had finished but its answer died with the process
    for i in (0, 1):
        q.returned(i, 0)
    assert q.died(0) is False and q.died(1) is False     # neither is blamed for a death they shared
    assert q.next_for(0) == 0 and q.next_for(0) is None  # 0 runs alone: nothing queued behind it
    q.returned(0, 0)                                      # and answers
    assert q.next_for(0) == 1 and q.next_for(0) is None
    q.returned(1, 0)
    assert q.died(1) is False                             # its second death, the first alone
    assert q.next_for(0) == 1
    q.returned(1, 0)
    assert q.died(1) is True                              # the third: it is the one to blame
    # a call sent to an actor that was coming back is sent again as it was, before new calls
    q = PoolQueue(n_calls=3, n_actors=2)
    assert [q.next_for(0), q.next_for(1)] == [0, 1]
    q.returned(1, 1)
    q.resend(1)
    assert q.next_for(1) == 1 and q.next_for(1) == 2


def _simulate_pool(n_calls: int, n_actors: int, kills: dict, rng: random.Random):
    """Drive PoolQueue as model_pool.run_pool does against actors that run their queue in order, where
    call i kills its actor the first kills[i] times it runs (-1: every time); a kill also loses the
    answers of calls that finished on that actor but were not yet read (the answer still in the dying
    process), and the driver reads the answers in any order. Returns (finished calls, blamed call)."""
    q = PoolQueue(n_calls, n_actors)
    fifo = [[] for _ in range(n_actors)]           # calls sent to each actor, not yet run
    ready: list[tuple[int, int, bool]] = []        # (call, actor, died) the driver can read
    unread = [[] for _ in range(n_actors)]         # answers of finished calls still in the process
    done, runs = set(), {i: 0 for i in kills}
    while len(done) < n_calls:
        for a in range(n_actors):
            while (i := q.next_for(a)) is not None:
                fifo[a].append(i)
        busy = [a for a in range(n_actors) if fifo[a]]
        if busy and (not ready or rng.random() < 0.5):
            a = rng.choice(busy)
            i = fifo[a].pop(0)
            runs[i] = runs.get(i, 0) + 1
            if i in kills and (kills[i] < 0 or runs[i] <= kills[i]):
                lost = [j for j in unread[a] if rng.random() < 0.5]
                ready = [r for r in ready if not (r[0] in lost and r[1] == a)]
                ready += [(j, a, True) for j in [i] + fifo[a] + lost]
                unread[a] = [j for j in unread[a] if j not in lost]
                fifo[a] = []
            else:
                unread[a].append(i)
                ready.append((i, a, False))
            continue
        i, a, died = ready.pop(rng.randrange(len(ready)))
        if i in unread[a]:
            unread[a].remove(i)
        q.returned(i, a)
        if not died:
            done.add(i)
        elif q.died(i):
            return done, i
    return done, None


def test_the_pool_blames_the_call_that_kills_its_actor_whatever_order_the_answers_come_back_in():
    for seed in range(300):
        rng = random.Random(seed)
        n_calls, n_actors = rng.randint(2, 12), rng.randint(1, 3)
        killer = rng.randrange(n_calls)
        done, blamed = _simulate_pool(n_calls, n_actors, {killer: -1}, rng)
        assert blamed == killer, seed
        # killed twice, then it fits: every call finishes, none is blamed
        done, blamed = _simulate_pool(n_calls, n_actors, {killer: 2}, random.Random(seed))
        assert blamed is None and done == set(range(n_calls)), seed


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
