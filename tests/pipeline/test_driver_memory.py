"""Stage level: a real stage (basic) over 300,000 samples under a cap on the driver's memory.

Version one brought every sample's verdict, caption and size to the driver (about 0.8 KB per sample
per stage, measured in issue 13: 240 MB here). Now the workers write the partitions and the driver
only counts, so its RSS may not grow by more than CAP_MB while the stages run. A sampler thread
enforces the cap from inside the driver process (RLIMIT_AS cannot be used: Ray maps its object store
into the driver's address space).
"""
import sys
import threading
import time

import psutil
import pyarrow as pa
import pytest
import ray.cloudpickle

from pipeline.config import load_config
from pipeline.runner import run_pipeline
from stages.base import KEPT, Stage, StageResult
from stages.filters.basic import BasicStage
from stages.dataplane import write_part

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # Ray workers cannot import tests/

ROWS, PER_PART, CAP_MB = 300_000, 10_000, 100
pytestmark = pytest.mark.slow


def _ingested(storage, part: int, rows: int) -> dict:
    """A worker writes one partition of ingested-looking samples (captions, original sizes)."""
    keys = [f"s{part:03d}{i:06d}" for i in range(rows)]
    caps = [f"a &amp; photo of   thing {i} in set {part}" if i % 10 else "x" for i in range(rows)]
    t = pa.table({"key": keys, "verdict": [KEPT] * rows, "reason": [""] * rows, "caption": caps,
                  "width": pa.array([40 if i % 17 == 0 else 300 for i in range(rows)], pa.int64()),
                  "height": pa.array([300] * rows, pa.int64())})
    return write_part(storage, "ingested", f"p{part:03d}", None, keys, t)


class Ingested(Stage):
    name = "ingested"

    def section(self, config):
        return {"n": config.source.num_samples}

    def run(self, ctx):
        import ray

        n = ctx.cfg["n"]
        task = ray.remote(num_cpus=0.5)(_ingested)
        return StageResult(ray.get([task.remote(ctx.storage, p, min(PER_PART, n - p * PER_PART))
                                    for p in range(-(-n // PER_PART))]))


class Cap(threading.Thread):
    def __init__(self, limit_bytes: int):
        super().__init__(daemon=True)
        self.me, self.limit, self.peak, self.done = psutil.Process(), limit_bytes, 0, False

    def run(self):
        while not self.done:
            self.peak = max(self.peak, self.me.memory_info().rss)
            if self.peak > self.limit:
                import os

                print(f"driver memory cap exceeded: {self.peak / 2**20:.0f} MB", flush=True)
                os._exit(3)   # a cap: the run dies, as it would under a container's memory limit
            time.sleep(0.02)


def test_basic_stage_on_300k_samples_under_a_driver_memory_cap(tmp_path, ray_local):
    cfg = lambda n: load_config(None, [f"source.num_samples={n}", "stages.basic.examples_per_reason=2"])  # noqa: E731
    stages = [Ingested(), BasicStage()]
    run_pipeline(cfg(200), tmp_path / "warm", log=lambda m: None, stages=stages, observers=[])  # imports, worker pool
    base = psutil.Process().memory_info().rss
    cap = Cap(base + CAP_MB * 2 ** 20)
    cap.start()
    summary = run_pipeline(cfg(ROWS), tmp_path / "big", log=lambda m: None, stages=stages, observers=[])
    cap.done = True
    cap.join()
    grew = (cap.peak - base) / 2 ** 20
    print(f"driver RSS {base / 2**20:.0f} MB before, peak {cap.peak / 2**20:.0f} MB (+{grew:.0f} MB) for {ROWS} samples")
    basic = summary["basic"]
    assert basic["in"] == ROWS and basic["partitions"] == ROWS // PER_PART
    assert basic["dropped"] == {"caption_too_short": ROWS // 10, "image_too_small": basic["dropped"]["image_too_small"]}
    small = sum(1 for i in range(PER_PART) if i % 17 == 0 and i % 10) * (ROWS // PER_PART)
    assert basic["dropped"]["image_too_small"] == small
    assert basic["captions_repaired"] == basic["kept"] == ROWS - ROWS // 10 - small   # every kept one: "&amp;"
    assert basic["kept"] + sum(basic["dropped"].values()) == ROWS
    assert grew < CAP_MB
