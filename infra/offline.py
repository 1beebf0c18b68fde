"""Keep every process capline starts from talking to the outside world unasked.

Third-party parts phone home by default: Ray's dashboard probes cloud metadata addresses at
start-up whatever RAY_USAGE_STATS_ENABLED says, MLflow sends telemetry, albumentations (via
img2dataset) checks for updates, wandb reports, hub clients try to download. `apply()` sets the
switches that turn each off in os.environ, and puts infra/procenv/ on PYTHONPATH so every child
Python loads its sitecustomize, which disarms Ray's metadata probe (see there) and, with
CAPLINE_NETGUARD=1, installs the network guard. Set CAPLINE_TELEMETRY=1 to leave all of it as
the libraries default.
"""
from __future__ import annotations

import os
from pathlib import Path

PROCENV_DIR = Path(__file__).resolve().parent / "procenv"

# Ray's per-node metrics exporter answers plain HTTP /metrics on 0.0.0.0, token or not (seen with
# 2.60): a local cluster is not to be read from the LAN. RAY_enable_metrics_collection=1 brings it back.
RAY_PRIVATE_ENV = {"RAY_enable_metrics_collection": "0"}

QUIET_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_USAGE_STATS_PROMPT_ENABLED": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "NO_ALBUMENTATIONS_UPDATE": "1",
    "WANDB_MODE": "disabled",
    "WANDB_SILENT": "true",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}

# Ray forwards every worker's stdout and stderr to the driver: its own INFO lines (Ray Train's
# "Reporting training result ...", C++ core warnings, DDP set-up) in a run that went well. What
# capline's workers say starts "<stage or tool>: " in lower case; every other forwarded line is
# left in Ray's log files (the session's logs/ folder, printed at start), where errors are too.
# CAPLINE_RAY_LOGS=1 forwards everything, as Ray does by default.
RAY_QUIET_ENV = {
    "RAY_DEDUP_LOGS_SKIP_REGEX": r"^(?![a-z][a-z_]*( [a-z_]+)?: )",
    "RAY_DISABLE_WORKER_LOG_PREFIX": "1",
}


def telemetry_allowed() -> bool:
    return os.environ.get("CAPLINE_TELEMETRY", "") in ("1", "true", "yes")


def procenv(env: dict[str, str]) -> dict[str, str]:
    """Return env with infra/procenv first on PYTHONPATH, so every child Python loads it."""
    env = dict(env)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(PROCENV_DIR) not in parts:
        parts.insert(0, str(PROCENV_DIR))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def guard_env(env: dict[str, str], log_path: str | None = None) -> dict[str, str]:
    """Return env that turns the network guard on in every child Python."""
    env = procenv(env)
    env["CAPLINE_NETGUARD"] = "1"
    if log_path:
        env["CAPLINE_NETGUARD_LOG"] = log_path
    return env


def apply(ray_auth_for_local: bool = True) -> None:
    """Quiet switches and procenv for children; procenv's hooks in this process too; and, unless the
    caller decides later (the CLI, which knows whether it joins a cluster), Ray's token auth for a
    cluster this process starts (else Ray 2.60 writes a world-readable ~/.ray/auth_token itself)."""
    if ray_auth_for_local:
        ray_auth(joining=False)
    for key, value in RAY_PRIVATE_ENV.items():
        os.environ.setdefault(key, value)
    if not telemetry_allowed():
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)
    if os.environ.get("CAPLINE_RAY_LOGS", "") not in ("1", "true", "yes"):
        for key, value in RAY_QUIET_ENV.items():
            os.environ.setdefault(key, value)
    os.environ.update(procenv(dict(os.environ)))
    import importlib.util

    spec = importlib.util.spec_from_file_location("_capline_procenv", PROCENV_DIR / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # idempotent: the guard and the import patch install once


def check_private(path: Path, what: str) -> None:
    """A secret file must be this user's and readable by nobody else (Ray 2.60 writes its
    ~/.ray/auth_token 0644): refuse it otherwise, saying how to fix it."""
    from infra.errors import UserError

    if path.is_symlink():   # a link can point at a file another user controls, or change under us
        raise UserError(f"{what} ({path}) is a symbolic link; use a token file of your own, not a link to one")
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise UserError(f"{what} ({path}) belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): "
                        "another user could have chosen the token; use a token file of your own")
    if st.st_mode & 0o077:
        raise UserError(f"{what} ({path}) is readable by other users (mode {st.st_mode & 0o777:o}), so any of them "
                        f"could join your Ray cluster; run: chmod 600 {path}")


def ray_auth(joining: bool) -> dict[str, str]:
    """Turn Ray's token authentication on for a cluster this process will start (before Ray is
    imported: it reads the mode then). The token is the user's own (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token) or one made once in capline's cache, mode 0600. A
    process that joins a cluster keeps whatever the user set for it. -> what was set."""
    if joining or os.environ.get("RAY_AUTH_MODE"):
        return {}
    if os.environ.get("RAY_AUTH_TOKEN"):
        env = {"RAY_AUTH_MODE": "token"}
    elif os.environ.get("RAY_AUTH_TOKEN_PATH"):
        check_private(Path(os.environ["RAY_AUTH_TOKEN_PATH"]), "RAY_AUTH_TOKEN_PATH")
        env = {"RAY_AUTH_MODE": "token"}
    elif (Path.home() / ".ray" / "auth_token").is_file():
        check_private(Path.home() / ".ray" / "auth_token", "~/.ray/auth_token")
        env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(Path.home() / ".ray" / "auth_token")}
    else:
        import secrets

        path = Path(os.environ.get("CAPLINE_CACHE", "~/.cache/capline")).expanduser() / "ray_auth_token"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:   # 0600 from the start: never readable by others, not even for an instant
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        except FileExistsError:   # made by an earlier run: used only as it was made (never chmodded into use)
            check_private(path, "capline's Ray token")
        env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}
    os.environ.update(env)
    return env
