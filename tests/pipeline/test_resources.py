"""Resources sized per node: a request the cluster cannot place is said in one line naming the
setting, before anything waits; a node the object store refuses is named, not a traceback."""
import os
import re

import pytest

from helpers import moto_s3
from infra.errors import UserError
from infra.storage import Storage
from pipeline.executor import Executor
from trainers.run import check_fits
from trainers.train_config import TrainConfig


def test_training_that_the_cluster_cannot_place_is_refused_naming_the_setting():
    shape = {"cpus": 2.0, "gpus": 0.0, "nodes": 2}
    check_fits(TrainConfig(num_workers=2), shape)
    with pytest.raises(UserError, match="train.num_workers is 4 .* the cluster has 2 CPUs on 2 node"):
        check_fits(TrainConfig(num_workers=4), shape)
    with pytest.raises(UserError, match="set train.use_gpu: false"):
        check_fits(TrainConfig(num_workers=1, use_gpu=True), shape)


BUCKET = "capline-creds"


@pytest.fixture(scope="module")
def s3_env():
    yield from moto_s3(BUCKET)


def _read(storage):
    return storage.read_bytes("x.txt")


@pytest.mark.slow
def test_a_node_the_bucket_refuses_is_named_in_one_line(s3_env, ray_local, monkeypatch):
    env, client = s3_env
    client.put_object(Bucket=BUCKET, Key="run/x.txt", Body=b"hello")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    uri = f"s3://{BUCKET}/run"
    storage = Storage.from_uri(uri)
    assert storage.read_bytes("x.txt") == b"hello"          # the driver's credentials work
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])      # tests/ is not on the workers' path
    with pytest.raises(UserError) as err:
        # the shared cluster's workers started before the bucket's keys were set: a node without them
        Executor(log=lambda m: None).run(_read, [(storage,)], "numbers")
    message = str(err.value)
    assert re.search(r"numbers: task 0: the object store refused node [0-9a-f.:]+ \((ACCESS_DENIED|INVALID_ACCESS_KEY_ID|Unable to locate credentials)\); "
                     "give that node the run folder's credentials", message), message
    assert "\n" not in message and "Traceback" not in message


def test_a_request_no_alive_node_can_meet_is_said_with_the_setting(monkeypatch):
    """A node left mid-stage and the largest one now is smaller than a task's request: the stall
    check (every poll, 10 s) says so in one line naming the setting, instead of waiting forever."""
    from pipeline.sizing import NodeShape

    ex = Executor(log=lambda m: None)
    monkeypatch.setattr(ex, "shape", lambda: NodeShape(cpus=3.0, largest_cpus=1.0, largest_gpus=0.0, nodes=3))
    ex.check_still_feasible(1.0, 0.0, "dedup describe", "stages.dedup.cpus_per_worker")    # fits: no error
    with pytest.raises(UserError, match=r"dedup describe: its tasks ask for 2 CPU\(s\) and no alive node has that "
                                        r"much now \(3 nodes, largest 1 CPUs.*lower stages.dedup.cpus_per_worker"):
        ex.check_still_feasible(2.0, 0.0, "dedup describe", "stages.dedup.cpus_per_worker")
    assert Executor.poll_seconds <= 60
