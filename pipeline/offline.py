"""Keep every process capline starts from talking to the outside world unasked.

Third-party parts phone home by default: Ray's dashboard probes cloud metadata addresses at
start-up whatever RAY_USAGE_STATS_ENABLED says (so capline starts Ray without its dashboard),
MLflow sends telemetry, albumentations (via img2dataset) checks for updates, wandb reports, hub
clients try to download. `apply()` sets the switches that turn each off, in os.environ, so child
processes inherit them. Set CAPLINE_TELEMETRY=1 to leave all of them as the libraries default.

CAPLINE_NETGUARD=1 additionally installs the audit hook in pipeline/netguard/ in this process and
in every child (via PYTHONPATH): any non-loopback connection is then refused and logged.
"""
from __future__ import annotations

import os
from pathlib import Path

NETGUARD_DIR = Path(__file__).resolve().parent / "netguard"

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
    # Ray 2.60 otherwise writes ~/.ray/auth_token on first start.
    "RAY_AUTH_MODE": "disabled",
}


def telemetry_allowed() -> bool:
    return os.environ.get("CAPLINE_TELEMETRY", "") in ("1", "true", "yes")


def guard_env(env: dict[str, str], log_path: str | None = None) -> dict[str, str]:
    """Return env with the network guard on PYTHONPATH, so every child Python inherits it."""
    env = dict(env)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(NETGUARD_DIR) not in parts:
        parts.insert(0, str(NETGUARD_DIR))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["CAPLINE_NETGUARD"] = "1"
    if log_path:
        env["CAPLINE_NETGUARD_LOG"] = log_path
    return env


def apply() -> None:
    """Set the quiet switches (unless CAPLINE_TELEMETRY=1) and the guard (if CAPLINE_NETGUARD=1)."""
    if not telemetry_allowed():
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)
    if os.environ.get("CAPLINE_NETGUARD") == "1":
        os.environ.update(guard_env(dict(os.environ)))
        import importlib.util

        spec = importlib.util.spec_from_file_location("_capline_netguard", NETGUARD_DIR / "sitecustomize.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # installs the hook in this process (idempotent)
