"""Downloading politely, per host, within one download process (a Ray task of ingest).

Sites block, and report, bulk downloaders that ignore them. For every host a process fetches from:
- a token bucket: at most `rate` requests per second and `concurrency` at once (ingest divides
  the configured cluster-wide rate by the tasks that run at once, so the cluster as a whole keeps it);
- 429 and 503 answered with a wait: the `Retry-After` the server gives (seconds or an HTTP date),
  else exponential backoff (1, 2, 4 ... s), and the whole host pauses, not only that request; a wait
  longer than `max_wait`, or more than `retries` of them, ends the URL as `rate_limited`;
- a circuit breaker: after `breaker_failures` consecutive failures (network errors, 5xx), the host
  is not asked again in this process; its remaining URLs end as `host_unavailable`;
- robots.txt, fetched once per host through the same pinned, address-checked fetcher, honoured for
  the `token` (RFC 9309: a 4xx robots.txt allows everything, an unreachable one (5xx, network)
  disallows everything); the token is in the User-Agent too.
Every decision is a verdict the ledger records with its reason.
"""
from __future__ import annotations

import email.utils
import threading
import time
import urllib.robotparser
from dataclasses import dataclass


@dataclass(frozen=True)
class Manners:
    token: str = "capline"            # the robots.txt user-agent token, also in the User-Agent
    rate: float = 5.0                 # requests per second per host, in this process
    concurrency: int = 4              # requests in flight per host, in this process
    robots: bool = True               # honour robots.txt
    max_wait: float = 60.0            # the longest Retry-After waited for
    retries: int = 3                  # waits on 429/503 before the URL is given up
    breaker_failures: int = 20        # consecutive failures that stop asking a host
    wait_budget: float = 300.0        # seconds of Retry-After one task grants a host in all, then it gives up on it
    contact: str = ""                 # a URL or mail address a site's operator can reach the crawl's owner at

    @property
    def user_agent(self) -> str:
        """`compatible; <token>/<capline's version>; +<contact>`: what a site's logs show, so its operator can
        tell which crawler this is and whom to ask."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("capline")
        except PackageNotFoundError:
            v = "dev"
        return (f"Mozilla/5.0 (compatible; {self.token}/{v}; img2dataset-compatible dataset builder"
                + (f"; +{self.contact}" if self.contact else "") + ")")


class Host:
    """What one process knows of one host: its next free slot, its robots rules, its failures."""

    def __init__(self, manners: Manners):
        self.m = manners
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(max(1, manners.concurrency))
        self.next_free = 0.0
        self.failures = 0
        self.open = False
        self.robots: urllib.robotparser.RobotFileParser | None = None
        self.robots_note = ""
        self.robots_lock = threading.Lock()
        self.waited = 0.0
        self.slowdowns = 0
        self.spent = False                # asked to wait more than the task's wait budget grants it

    def take_slot(self) -> None:
        """Wait for this host's next request slot (rate) and a free connection (concurrency)."""
        self.slots.acquire()
        with self.lock:
            now = time.monotonic()
            at = max(now, self.next_free)
            self.next_free = at + 1.0 / max(self.m.rate, 1e-6)
        if at > now:
            time.sleep(at - now)

    def give_slot(self) -> None:
        self.slots.release()

    def pause(self, seconds: float) -> None:
        """The server asked to slow down: no request to this host before `seconds` from now."""
        with self.lock:
            self.next_free = max(self.next_free, time.monotonic() + seconds)
            self.waited += seconds
            self.slowdowns += 1

    def outcome(self, ok: bool) -> None:
        with self.lock:
            self.failures = 0 if ok else self.failures + 1
            if self.failures >= self.m.breaker_failures:
                self.open = True


def retry_after(value: str | None, attempt: int) -> float:
    """Seconds to wait: the server's Retry-After (delta-seconds or an HTTP date), else 2^attempt."""
    if value:
        value = value.strip()
        if value.isdigit():
            return float(value)
        try:
            when = email.utils.parsedate_to_datetime(value)
            return max(0.0, when.timestamp() - time.time())
        except (TypeError, ValueError):
            pass
    return float(2 ** attempt)


class Hosts:
    """Every host this process has fetched from, for one set of manners."""

    def __init__(self, manners: Manners):
        self.manners = manners
        self.lock = threading.Lock()
        self.hosts: dict[str, Host] = {}

    def get(self, netloc: str) -> Host:
        with self.lock:
            if netloc not in self.hosts:
                self.hosts[netloc] = Host(self.manners)
            return self.hosts[netloc]

    def robots_allow(self, host: Host, scheme: str, netloc: str, url: str, fetch) -> tuple[bool, str]:
        """Whether robots.txt lets the token fetch `url`; `fetch(url) -> (status, body)` is the safe
        fetcher. -> (allowed, why not)."""
        if not self.manners.robots:
            return True, ""
        with host.robots_lock:
            if host.robots is None:
                parser = urllib.robotparser.RobotFileParser()
                try:
                    status, body = fetch(f"{scheme}://{netloc}/robots.txt")
                except Exception as err:  # noqa: BLE001 - unreachable: RFC 9309 says disallow
                    status, body, host.robots_note = None, b"", f"robots.txt unreachable ({type(err).__name__})"
                if status is not None and 200 <= status < 300:
                    parser.parse(body.decode("utf-8", "replace").splitlines())
                elif status is not None and 400 <= status < 500:
                    parser.parse([])                       # no robots.txt: everything allowed
                else:
                    parser.disallow_all = True
                    host.robots_note = host.robots_note or f"robots.txt answered HTTP {status}"
                host.robots = parser
        if host.robots.can_fetch(self.manners.token, url):
            return True, ""
        return False, host.robots_note or "robots.txt disallows it"
