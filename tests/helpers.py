"""Helpers the tests import (conftest.py is pytest's; importing it again would run its set-up twice)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def capline(*args: str, timeout: float = 600, env: dict | None = None, cwd: Path | None = None):
    """Run the real `capline` CLI in a subprocess (guard inherited) and return the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd or ROOT)


def kill_driver(proc: subprocess.Popen) -> None:
    """SIGKILL a capline driver; then reap the Ray processes it leaves behind (Ray's agents outlive it)."""
    import psutil

    tree = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=20)
