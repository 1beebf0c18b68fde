"""Progress of a long step, with rate and ETA: a tqdm bar on a terminal, log lines elsewhere.

On a terminal (stderr is a TTY, and CAPLINE_PROGRESS is not 0) the bar redraws in place and only
the final line goes to the run's log. Elsewhere (CI, a log file, `| tee`) nothing redraws: a line
every `every` seconds and the last one, so a log stays readable and still shows a stuck step.
"""
from __future__ import annotations

import os
import sys
import time


def _terminal() -> bool:
    if os.environ.get("CAPLINE_PROGRESS", "") in ("0", "false", "no"):
        return False
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


def _eta(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}" if seconds >= 60 else f"{seconds}s"


class Progress:
    def __init__(self, what: str, total: int, log=print, unit: str = "partitions", every: float = 10.0,
                 initial: int = 0):
        self.what, self.total, self.log, self.unit, self.every = what, total, log, unit, every
        self.done, self.start, self.last = initial, time.time(), time.time()
        self.initial, self.extra, self.rate = initial, "", None
        self.bar = None
        if _terminal():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=what, unit=unit[:-1] if unit.endswith("s") else unit,
                            file=sys.stderr, dynamic_ncols=True, leave=False)

    def line(self) -> str:
        elapsed = max(time.time() - self.start, 1e-6)
        rate = self.rate if self.rate is not None else (self.done - self.initial) / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (f"{self.what}: {self.done}/{self.total} {self.unit}, {rate:.1f}/s, ETA {_eta(eta)}"
                + (f", {self.extra}" if self.extra else ""))

    def update(self, done: int | None = None, n: int = 1, rate: float | None = None, **postfix) -> None:
        """Advance by n, or to `done`; `rate`: units/s measured where the work runs (else from the
        count over wall time here); postfix values (loss=...) are shown beside the count."""
        new = self.done + n if done is None else done
        if rate is not None:
            self.rate = rate
        if postfix:
            self.extra = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in postfix.items())
        if self.bar is not None:
            self.bar.update(new - self.done)
            if postfix:
                self.bar.set_postfix_str(self.extra, refresh=False)
        self.done = new
        now = time.time()
        if self.bar is None and (now - self.last >= self.every) and self.done < self.total:
            self.log(self.line())
            self.last = now

    def stalled(self, seconds: float, running: int) -> None:
        """Nothing finished for a while: say so (a stuck task must not look like a quiet one)."""
        if self.bar is not None:
            self.bar.set_postfix_str(f"{running} running, none finished for {seconds:.0f}s")
        else:
            self.log(f"{self.what}: {self.done}/{self.total} done, {running} running for {seconds:.0f}s "
                     "without finishing")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.log(self.line())
