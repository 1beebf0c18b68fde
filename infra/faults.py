"""The driver's side of fault injection (the workers' side: pipeline/task_results.failpoint): with
CAPLINE_KILLPOINT=<what> in its environment, a command SIGKILLs itself at the point named `what`, so
the kill tests stop it between two of its writes (tests/e2e/test_remove_kills.py). Unset, each point
is one environment lookup."""
from __future__ import annotations

import os

KILLPOINT = "CAPLINE_KILLPOINT"


def killpoint(what: str) -> None:
    if os.environ.get(KILLPOINT) == what:
        import signal

        print(f"killpoint: {what}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
