"""Test-wide setup: the network guard, quiet telemetry, and one shared local Ray cluster.

Every process the tests start (Ray's workers and agents, img2dataset, subprocess CLIs) inherits
PYTHONPATH with infra/procenv, whose sitecustomize installs an audit hook that refuses and logs any non-loopback connection.
The autouse fixture fails the test during which anything was logged.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# One log per test process, whatever imports this module: the check below must read the very file
# that child processes write to, and no other worker's (test_netguard writes a line on purpose and
# takes it back; another worker's check reading between the two failed a test that did nothing)
_GUARD_LOG = Path(os.environ.get("CAPLINE_TEST_GUARD_LOG")
                  or Path(tempfile.mkdtemp(prefix="capline-netguard-")) / "refused.log")
if os.environ.get("PYTEST_XDIST_WORKER") and not _GUARD_LOG.stem.endswith(os.environ["PYTEST_XDIST_WORKER"]):
    _GUARD_LOG = _GUARD_LOG.with_name(f"{_GUARD_LOG.stem}-{os.environ['PYTEST_XDIST_WORKER']}.log")
os.environ["CAPLINE_TEST_GUARD_LOG"] = str(_GUARD_LOG)

from infra import offline  # noqa: E402

os.environ.update(offline.guard_env(dict(os.environ), str(_GUARD_LOG)))
# the tests' clusters run with token auth as capline's do (the token in a temp cache of the session)
os.environ.setdefault("CAPLINE_CACHE", tempfile.mkdtemp(prefix="capline-test-cache-"))
offline.apply()  # quiet switches, token auth + the hook in this very process
os.environ.setdefault("RAY_TMPDIR", "/tmp")
# the suite runs two test processes on 2 cores, each starting Ray workers: OpenMP threads that spin
# while they wait (libgomp's default) take the core from the process they wait for. Passive waits:
# 40 steps of the bootstrap scorer beside two busy processes took 11.4 s instead of 18.7 s
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# an S3 client without credentials asks the EC2 metadata service for some, from C++ the guard
# cannot see: no process the tests start may try
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"


def guard_log_lines() -> list[str]:
    return _GUARD_LOG.read_text().splitlines() if _GUARD_LOG.exists() else []


@pytest.fixture(autouse=True)
def no_outside_traffic():
    before = len(guard_log_lines())
    yield
    new = guard_log_lines()[before:]
    assert not new, "a process tried to reach a non-loopback address:\n" + "\n".join(new)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster (2 CPUs) shared by the stage tests: each start costs ~10 s."""
    import ray

    from infra.ray_runtime import RayConfig, ray_session

    with ray_session(RayConfig(num_cpus=2, object_store_memory_mb=256), log=lambda m: None):
        yield ray
    assert not ray.is_initialized()


@pytest.fixture(scope="session", autouse=True)
def no_world_readable_ray_token():
    """Ray 2.60 writes ~/.ray/auth_token (mode 0644) when it starts a cluster with no auth mode set:
    every Ray the tests start must have capline's token settings instead."""
    token = Path.home() / ".ray" / "auth_token"
    existed = token.exists()
    yield
    assert existed or not token.exists(), f"a Ray cluster started without capline's token settings wrote {token}"



def pytest_collection_modifyitems(session, config, items):
    """Under pytest-xdist (`make test`, whole files to a worker, `--no-loadscope-reorder`): the files
    that took longest in a measured serial run first (tests/file_seconds.json; a file not listed
    counts as short), so no long file starts last on one worker while the other idles. xdist's
    own order, by number of tests, left the two-node test (two tests, three minutes) for last."""
    import json

    if os.environ.get("PYTEST_XDIST_WORKER"):
        seconds = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
        items.sort(key=lambda it: -seconds.get(it.nodeid.split("::", 1)[0], 0))   # stable: a file's order kept
