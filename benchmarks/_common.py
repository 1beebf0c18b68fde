"""Shared helpers for the benchmarks: results files and the environment they ran in."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def code() -> str:
    """The commit the benchmark ran (short), for its results entry."""
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def write_results(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2, sort_keys=True))
    print(f"wrote {path}")
    return path


def merge_run(name: str, label: str, result: dict) -> Path:
    """`result` written into results/<name>.json under runs[label], the file's other runs and keys kept."""
    path = RESULTS / f"{name}.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.pop("machine", None)
    data["runs"] = {**data.get("runs", {}), label: result}
    return write_results(name, data)
