"""Start or join a Ray cluster with capline's defaults.

Local by default (`ray.init()` sized from config); `--address` / RAY_ADDRESS / `ray.address` join a
running cluster. A local cluster starts Ray's dashboard, on loopback, when the command trains (Ray
Train's placement-group cleaner reaches the State API through it) or `ray.dashboard: true` asks for
it; otherwise not (it adds 1-2.5 s to every start, ~4 % of a small append's command). Its start-up
probe of cloud metadata addresses is disarmed in every process capline starts (infra/procenv).

A local cluster runs with Ray's token authentication (`RAY_AUTH_MODE=token`). Ray binds its GCS,
raylets and agents to every interface whatever node address it is given (seen with Ray 2.60:
`::`, `0.0.0.0` and the routable address), so the token is what keeps the LAN out: without it a
client cannot join and the job-submission API answers 401. The token is the user's own
(`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`, or `~/.ray/auth_token` if it exists), else one capline
makes once in its cache (`~/.cache/capline/ray_auth_token`, mode 0600). Ray reads the mode when it
is imported, so infra/offline.py `ray_auth()` sets it first thing in the CLI. A joined cluster
(`--address`) uses whatever auth it was started with: set RAY_AUTH_MODE=token and the token
variables to match (capline's own `make`-started nodes and infra/ manifests do).
"""
from __future__ import annotations

import gc
import logging
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass

from infra.configtools import join, require
from infra.errors import UserError


@dataclass
class RayConfig:
    address: str | None = None          # null: start a local cluster
    num_cpus: int | None = None         # local cluster only; null: all cores
    object_store_memory_mb: int = 1024  # local cluster only
    # Ray's dashboard with a local cluster: null starts it when the command trains (Ray Train needs
    # it), true always (to watch a data run), false never; its cloud probes are switched off
    dashboard: bool | None = None

    def validate(self, prefix: str) -> None:
        require(self.dashboard in (None, True, False), join(prefix, "dashboard"),
                f"must be true, false or null (started when the command trains), got {self.dashboard!r}")
        require(self.num_cpus is None or self.num_cpus >= 1, join(prefix, "num_cpus"), "must be >= 1 or null")
        require(self.object_store_memory_mb >= 80, join(prefix, "object_store_memory_mb"),
                f"must be at least 80 (MB), got {self.object_store_memory_mb}")


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"Ray address {address!r} is not HOST:PORT (e.g. 127.0.0.1:6379), 'auto' or 'local'")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as err:
        raise UserError(f"cannot reach a Ray cluster at {address} ({err.strerror or err}); "
                        "start one with `ray start --head`, or leave out --address to use a local one") from None


def private_temp_dir() -> str:
    """Ray's temp root for a local cluster this user starts: inside a folder per user, mode 0700. Ray's default
    (/tmp/ray) is shared by every user and its session folders are 0777 without the sticky bit,
    so anyone on the machine could read the logs or swap a socket. Kept short: Ray's socket paths
    live under it."""
    import tempfile

    path = os.path.join(os.environ.get("CAPLINE_RAY_TMPDIR") or tempfile.gettempdir(), f"capline-ray-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.geteuid():
        raise UserError(f"{path} (Ray's temp folder) is not a folder of yours; remove it or set CAPLINE_RAY_TMPDIR "
                        "to a folder of your own")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return os.path.join(path, "r")     # Ray makes its own root 0777: the 0700 fence is the folder above


def prune_sessions(root: str, keep: int = 3) -> list[str]:
    """Remove the session folders (2-3 MB of logs and sockets each, one per command) of local
    clusters whose driver is gone, but the newest `keep` (the last runs' logs, for a bug report).
    Ray names a session `session_<date>_<time>_<microseconds>_<pid of the process that started it>`;
    a local cluster ends with that process. -> the folders removed."""
    import re
    import shutil

    import psutil

    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = re.fullmatch(r"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_(\d+)", name)
        path = os.path.join(root, name)
        if m and not os.path.islink(path) and not psutil.pid_exists(int(m.group(1))):
            found.append(path)
    gone = sorted(found)[:-keep] if keep else sorted(found)
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


# Ray kills a worker that idles for 1 s once a node has more workers than CPUs, and every new worker
# imports torch and the stage's libraries again (~2 s of CPU). Stages follow each other with short
# planning gaps, so a run paid that over and over: the demo at 600 samples started 28 worker
# processes on 2 CPUs and took 121 s; keeping idle workers 60 s, 9 processes and 81 s.
NODE_ENV = {"RAY_idle_worker_killing_time_threshold_ms": "60000"}


def node_env() -> None:
    """Set capline's Ray node settings in os.environ (a local cluster's raylet and `ray start` read them
    there); a value the user set wins."""
    for key, value in NODE_ENV.items():
        os.environ.setdefault(key, value)


def wants_dashboard(cfg: RayConfig, trains: bool) -> bool:
    """Whether a local cluster starts Ray's dashboard: as `ray.dashboard` says, else when it trains."""
    return cfg.dashboard if cfg.dashboard is not None else trains


@contextmanager
def ray_session(cfg: RayConfig, address: str | None = None, log=print, trains: bool = True):
    """Yield with Ray initialised; shut down what this call started. `trains`: the command runs Ray
    Train (a local cluster then has the dashboard, unless `ray.dashboard: false`)."""
    import ray

    if ray.is_initialized():
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS") or cfg.address
    if address in ("local", ""):
        address = None
    if address and address != "auto":
        _check_reachable(address)
    common = dict(logging_level=logging.WARNING, log_to_driver=True, configure_logging=True)
    if address:
        log(f"ray: joining the cluster at {address}")
        host = address.split("://", 1)[-1].rpartition(":")[0]
        if host in ("127.0.0.1", "localhost"):
            common["_node_ip_address"] = "127.0.0.1"   # a loopback cluster: the driver lives there too
        # Workers of a cluster started by `ray start` inherit that shell's environment, not this
        # driver's: hand them capline's quiet switches (else e.g. albumentations asks pypi.org for
        # updates from every worker that imports img2dataset).
        from .offline import QUIET_ENV

        quiet = {k: os.environ[k] for k in QUIET_ENV if k in os.environ}
        ray.init(address=address, runtime_env={"env_vars": quiet} if quiet else None, **common)
    else:
        num_cpus = cfg.num_cpus or os.cpu_count() or 1
        node_env()
        log(f"ray: starting a local cluster ({num_cpus} CPUs, {cfg.object_store_memory_mb} MB object store)")
        # A local cluster lives on loopback: Ray otherwise finds its node address by asking the
        # route to an outside address. address="local": a new cluster, never one that `ray start`
        # left in /tmp/ray/ray_current_cluster (plain ray.init() would join that, or its corpse).
        prune_sessions(private_temp_dir())
        ray.init(address="local", num_cpus=num_cpus, object_store_memory=cfg.object_store_memory_mb * 2**20,
                 include_dashboard=wants_dashboard(cfg, trains), dashboard_host="127.0.0.1", _node_ip_address="127.0.0.1",
                 _temp_dir=private_temp_dir(), **common)
    # Ray Data logs every operator's progress at INFO; capline prints its own per-stage progress.
    for name in ("ray.data", "ray.data._internal"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield
    finally:
        # Ray Data leaves cycles of its objects (plans, operators) holding ObjectRefs; collected by a
        # later GC pass during ray.shutdown(), a ref's release reaches a core worker that is going
        # away, and Ray ends the process with status 1 after a finished run ("The core worker has
        # already been shutdown ... The process will exit": 1 of 11 capline commands in
        # tests/e2e/test_remove.py and test_rebuild.py, 0 of 22 with this). Collected here, while
        # Ray is up.
        gc.collect()
        ray.shutdown()
