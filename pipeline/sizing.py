"""How much of the cluster a group of tasks may use, and how much it did: what the alive nodes
declare (`NodeShape`), how many actors of a request they hold, what one task may ask for, how many
tasks to keep submitted, and where a group of tasks' time went (`spans`). Pure given a shape: the
executor asks Ray for the shape once per run of tasks."""
from __future__ import annotations

import math
from dataclasses import dataclass

from infra.errors import UserError


@dataclass
class NodeShape:
    """What the alive nodes of the cluster declare: total CPUs, the largest node's CPUs and GPUs."""
    cpus: float
    largest_cpus: float
    largest_gpus: float
    nodes: int
    per_node: tuple = ()     # (CPUs, GPUs, memory bytes) of each alive node: how many actors fit

    @classmethod
    def now(cls) -> "NodeShape":
        import ray

        alive = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        cpus = [r.get("CPU", 0.0) for r in alive] or [1.0]
        gpus = [r.get("GPU", 0.0) for r in alive] or [0.0]
        return cls(cpus=sum(cpus), largest_cpus=max(cpus), largest_gpus=max(gpus), nodes=len(alive),
                   per_node=tuple((r.get("CPU", 0.0), r.get("GPU", 0.0), r.get("memory", 0.0)) for r in alive))


def actors_that_fit(num_cpus: float, num_gpus: float, memory: float, shape: NodeShape) -> int:
    """How many actors asking for `num_cpus`, `num_gpus` and `memory` bytes the alive nodes hold at
    once: each node's room counted on its own (two half-full nodes do not hold one more)."""
    total = 0
    for cpus, gpus, mem in shape.per_node:
        room = [math.floor(cpus / num_cpus + 1e-9) if num_cpus > 0 else 10 ** 6]
        if num_gpus:
            room.append(math.floor(gpus / num_gpus + 1e-9))
        if memory:
            room.append(math.floor(mem / memory))
        total += max(0, min(room))
    return total


def fit_request(num_cpus: float, num_gpus: float, shape: NodeShape, what: str, setting: str | None = None) -> float:
    """The CPUs a task may ask for on this cluster: at most the largest node's. A GPU request that no
    node can meet is a UserError naming `setting`."""
    if num_gpus and num_gpus > shape.largest_gpus:
        where = f"set {setting} to 0 or " if setting else ""
        raise UserError(f"{what}: its tasks ask for {num_gpus:g} GPU(s) and no node of the cluster has "
                        f"{'any' if not shape.largest_gpus else f'more than {shape.largest_gpus:g}'}; "
                        f"{where}add a node with GPUs")
    return min(num_cpus, shape.largest_cpus) if num_cpus > 0 else num_cpus


def in_flight(num_cpus: float, shape: NodeShape, items: list[int] | None = None,
              items_per_worker: int | None = None) -> int:
    """Tasks to keep submitted: every CPU busy, and as many again queued so none waits for the driver.
    With `items_per_worker`, also no more than one task per that many of the `items` (URLs, rows) the
    calls work through: each task Ray starts at once may be a new worker process (seconds of start
    and imports), worth it only for that much work. An append of 80 URLs in 20 shards on a head
    declaring 16 CPUs started 16 processes for 1.2 s of downloads each, 13 s a shard on 2 real cores."""
    per_task = num_cpus if num_cpus > 0 else 0.25
    most = max(2, int(2 * math.ceil(shape.cpus / per_task)))
    if items is not None and items_per_worker:
        return max(1, min(most, math.ceil(sum(items) / items_per_worker)))
    return most


def spans(intervals: list[tuple[float, float]], t_start: float) -> dict:
    """Where a group of tasks' time went: the most running at once, how long the first waited to
    start (worker processes starting, a busy cluster), and the median and longest task."""
    if not intervals:
        return {"at_once": 0}
    took = sorted(t1 - t0 for t0, t1 in intervals)
    return {"at_once": max_overlap(intervals), "first_start_s": round(min(t0 for t0, _ in intervals) - t_start, 3),
            "task_s_median": round(took[len(took) // 2], 3), "task_s_max": round(took[-1], 3)}


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that hold at one instant (an end at t comes before a start at t)."""
    events = sorted([(t0, 1) for t0, _ in intervals] + [(t1, -1) for _, t1 in intervals], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most
