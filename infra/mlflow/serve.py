"""Start a shared MLflow tracking server for capline: a SQL backend store and an artifact root.

    python -m infra.mlflow.serve --root /srv/mlflow --port 5000           # SQLite + a folder
    MLFLOW_BACKEND_STORE_URI=postgresql://mlflow:PASS@db/mlflow python -m infra.mlflow.serve \\
        --artifacts-destination s3://my-bucket/mlflow --host 0.0.0.0 --port 5000 --auth proxy

A database password never goes on a command line (every user of the machine reads those in `ps`):
the backend store URI travels in MLFLOW_BACKEND_STORE_URI, which MLflow's server reads itself;
`--backend-store-uri` with a password in it is refused.

Then point capline at it: `MLFLOW_TRACKING_URI=http://HOST:5000 capline run ...` (every process
capline starts, and Ray Train's workers, get the URI from the driver). With `--artifacts-destination`
the server proxies artifact uploads, so clients need no storage credentials; the server does
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, MLFLOW_S3_ENDPOINT_URL for S3-compatible stores).
Telemetry is off (capline's quiet environment) and the server binds 127.0.0.1 unless told otherwise;
an address other machines reach needs `--auth basic` (MLflow's basic-auth app) or `--auth proxy`
(an authenticating reverse proxy in front), else the server refuses to start.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def command(artifacts: str, host: str, port: int, workers: int = 1, auth: str = "none") -> list[str]:
    """The server's command line: no backend store URI (it goes in the environment, see server_env)."""
    mlflow = Path(sys.executable).parent / "mlflow"
    return [str(mlflow) if mlflow.exists() else "mlflow", "server",
            "--artifacts-destination", artifacts, "--serve-artifacts", "--host", host, "--port", str(port),
            "--workers", str(workers)] + (["--app-name", "basic-auth"] if auth == "basic" else [])


def server_env(backend_uri: str) -> dict[str, str]:
    return {**os.environ, "MLFLOW_BACKEND_STORE_URI": backend_uri}


def secret_on_command_line(uri: str | None) -> str | None:
    import urllib.parse

    if uri and urllib.parse.urlsplit(uri).password:
        return ("--backend-store-uri holds a password, which every user of this machine can read in `ps`; "
                "pass the URI in MLFLOW_BACKEND_STORE_URI instead")
    return None


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, auth: str) -> str | None:
    """Why serving on `host` with `auth` is refused (None: allowed). MLflow's server has no
    authentication of its own: on an address other machines reach, anyone there could read and
    rewrite every run and artifact."""
    if is_loopback(host) or auth in ("basic", "proxy"):
        return None
    return (f"--host {host} would let anyone who reaches it read and change every run, without a password; "
            "add --auth basic (MLflow's basic-auth app: pip install 'mlflow[auth]', users in "
            "basic_auth.ini) or --auth proxy (a reverse proxy in front authenticates; see infra/README.md), "
            "or keep the default 127.0.0.1")


def defaults(root: Path) -> tuple[str, str]:
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")


# Idle, a fresh server answers in ~10 s (most of it creating the SQLite schema); on two loaded cores
# beside a Ray run, CI saw more than 90 s. Waiting is cheap; a server that has died is caught at once.
START_TIMEOUT = 300.0


def wait_ready(url: str, timeout: float = START_TIMEOUT, proc: subprocess.Popen | None = None,
               log_file: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    tail = ""
    if log_file is not None and Path(log_file).is_file():
        tail = "; its log ends: " + " | ".join(Path(log_file).read_text(errors="replace").splitlines()[-5:])
    raise TimeoutError(f"mlflow server at {url} not ready after {timeout:.0f}s{tail}")


def start(root: Path, port: int, host: str = "127.0.0.1", backend_uri: str | None = None,
          artifacts: str | None = None, log_file: Path | None = None,
          timeout: float = START_TIMEOUT) -> tuple[subprocess.Popen, str]:
    """Start the server in its own process group; -> (process, tracking URI) once /health answers."""
    from infra import offline

    offline.apply(ray_auth_for_local=False)   # quiet switches; it starts no Ray
    b, a = defaults(root)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    proc = subprocess.Popen(command(artifacts or a, host, port), stdout=out, stderr=subprocess.STDOUT,
                            env=server_env(backend_uri or b), start_new_session=True)
    url = f"http://{host}:{port}"
    wait_ready(url, timeout, proc=proc, log_file=log_file)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    """Stop the server and its gunicorn/uvicorn workers (its whole process group)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m infra.mlflow.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="mlflow-server", help="folder for the SQLite store and artifacts (default ./mlflow-server)")
    p.add_argument("--backend-store-uri", help="SQLAlchemy URI without a password, e.g. sqlite:////srv/mlflow.db "
                   "(default: MLFLOW_BACKEND_STORE_URI, else SQLite in --root)")
    p.add_argument("--artifacts-destination", help="artifact root, e.g. s3://bucket/mlflow (default: --root/artifacts)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--auth", choices=("none", "basic", "proxy"), default="none",
                   help="who checks passwords: none (loopback only), basic (MLflow's basic-auth app), or proxy "
                        "(a reverse proxy in front of it does; the server itself then trusts every request)")
    args = p.parse_args()
    why = secret_on_command_line(args.backend_store_uri) or check_exposure(args.host, args.auth)
    if why:
        print(f"serve: error: {why}", file=sys.stderr)
        return 2
    from infra import offline

    offline.apply(ray_auth_for_local=False)   # quiet switches; it starts no Ray
    b, a = defaults(Path(args.root))
    cmd = command(args.artifacts_destination or a, args.host, args.port, args.workers, args.auth)
    print(f"mlflow server: MLFLOW_TRACKING_URI=http://{args.host}:{args.port}", flush=True)
    os.execvpe(cmd[0], cmd, server_env(args.backend_store_uri or os.environ.get("MLFLOW_BACKEND_STORE_URI") or b))


if __name__ == "__main__":
    sys.exit(main())
