"""Downloading politely, per host, within one download process (a Ray task of ingest).

Sites block, and report, bulk downloaders that ignore them. For every host a process fetches from:
- a paced rate and `concurrency` requests at once (ingest divides the configured cluster-wide
  figures by the tasks that run at once, so the cluster as a whole keeps them). The rate adapts:
  it starts at `rate`, grows while the host answers quickly (x1.2 an answer until it first pushes
  back, then +rate/10 an answer) up to `max_rate` (and the host's robots.txt Crawl-delay, and a
  `limits` entry for it), halves when the host answers 429 or 503, and falls back toward `rate`
  when answers slow down. A host that never asks to slow down is not slowed to a guess;
- 429 and 503 answered with a wait: the `Retry-After` the server gives (seconds or an HTTP date),
  else exponential backoff (1, 2, 4 ... s), and the whole host pauses, not only that request; a wait
  longer than `max_wait`, or more than `retries` of them, ends the URL as `rate_limited`;
- the time threads wait for a host is counted (`Hosts.pacing`): thread-seconds asleep, and the
  seconds all of a task's busy threads were asleep at once, when the task held a CPU for nothing.
  A wait that would hold it so (every busy thread waiting, 0.2 s or more) is spent blocked on the
  run's `Pacer` actor instead: Ray takes the CPU back for another shard meanwhile (`yielded_s`); a
  thread already asleep when the others end or stop giving the CPU back gives it back for the rest;
- a circuit breaker: after `breaker_failures` consecutive failures (network errors, 5xx), the host
  is not asked again in this process; its remaining URLs end as `host_unavailable`;
- robots.txt, fetched once per host through the same pinned, address-checked fetcher, honoured for
  the `token` (RFC 9309: a 4xx robots.txt allows everything, an unreachable one (5xx, network)
  disallows everything); the token is in the User-Agent too.
Every decision is a verdict the ledger records with its reason.
"""
from __future__ import annotations

import email.utils
import functools
import threading
import time
import urllib.robotparser
from dataclasses import dataclass


@dataclass(frozen=True)
class Manners:
    token: str = "capline"            # the robots.txt user-agent token, also in the User-Agent
    rate: float = 5.0                 # requests per second per host at first, in this process
    max_rate: float | None = None     # the most it grows to while the host answers quickly (None: rate, fixed)
    share: int = 1                    # processes asking each host at once: a Crawl-delay or limit is divided by it
    limits: tuple = ()                # ((host or host:port, requests per second for the cluster), ...)
    quick: float = 1.0                # an answer within this many seconds lets the rate grow
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
        return (f"Mozilla/5.0 (compatible; {self.token}/{_version()}; img2dataset-compatible dataset builder"
                + (f"; +{self.contact}" if self.contact else "") + ")")


@functools.lru_cache(maxsize=1)
def _version() -> str:
    """capline's installed version, read once a process (importlib.metadata reads the disk: 3 % of a
    download task's CPU when asked per request)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("capline")
    except PackageNotFoundError:
        return "dev"


class Host:
    """What one process knows of one host: its pace, its robots rules, its failures."""

    def __init__(self, manners: Manners, netloc: str = "", sleep=time.sleep):
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
        self.spent: bool | str = False    # asked to wait more than the task grants it (str: why, when robots.txt asked)
        self.delay = 0.0                  # seconds between requests its robots.txt asks for
        self.sleep = sleep
        self.ceiling = max(manners.rate, manners.max_rate or manners.rate)
        hostname = netloc.rsplit(":", 1)[0] if not netloc.endswith("]") else netloc
        for who, limit in manners.limits:
            if who in (netloc, hostname):
                self.ceiling = min(self.ceiling, limit / max(1, manners.share))
        self.rate = min(manners.rate, self.ceiling)
        self.floor = self.rate / 16       # 429s halve the rate down to this
        self.pushed_back = False

    def take_slot(self) -> float | None:
        """Wait for this host's next request slot (rate) and a free connection (concurrency); -> seconds
        slept. None, with nothing reserved and the host spent for this task, when robots.txt's pace puts
        the slot further away than the task may wait on it: `max_wait` at once, `wait_budget` in all
        (a Crawl-delay of a day must not hold a run; capline's own adaptive pace never counts here)."""
        self.slots.acquire()
        with self.lock:
            now = time.monotonic()
            at = max(now, self.next_free)
            if self.delay and at - now > min(self.m.max_wait, self.m.wait_budget - self.waited):
                self.spent = self.spent or (f"its robots.txt asks {self.delay:g}s between requests, and the next would "
                                            f"wait {at - now:.0f}s, more than stages.ingest.max_retry_after "
                                            f"{self.m.max_wait:g}s at once or stages.ingest.host_wait_budget "
                                            f"{self.m.wait_budget:g}s in all")
                self.slots.release()
                return None
            self.next_free = at + 1.0 / max(self.rate, 1e-6)
            if self.delay:
                self.waited += at - now
        if at > now:
            self.sleep(at - now)
        return max(0.0, at - now)

    def give_slot(self) -> None:
        self.slots.release()

    def answered(self, seconds: float) -> None:
        """The host answered (anything but 429/503) in `seconds`: a quick answer lets its rate grow,
        a slow one brings it back toward the starting rate."""
        with self.lock:
            if seconds <= self.m.quick:
                grown = self.rate + self.m.rate / 10 if self.pushed_back else self.rate * 1.2
                self.rate = min(self.ceiling, grown)
            elif self.rate > self.m.rate:
                self.rate = max(min(self.m.rate, self.ceiling), self.rate * 0.9)

    def pause(self, seconds: float) -> None:
        """The server asked to slow down: no request to this host before `seconds` from now, and half the rate."""
        with self.lock:
            self.next_free = max(self.next_free, time.monotonic() + seconds)
            self.waited += seconds
            self.slowdowns += 1
            self.rate = max(self.floor, self.rate / 2)
            self.pushed_back = True

    def crawl_delay(self, seconds: float) -> None:
        """robots.txt asks for `seconds` between requests: the cluster's requests, so this process's share."""
        if seconds and seconds > 0:
            with self.lock:
                self.delay = seconds
                self.ceiling = min(self.ceiling, 1.0 / (seconds * max(1, self.m.share)))
                self.rate = min(self.rate, self.ceiling)

    def outcome(self, ok: bool) -> None:
        with self.lock:
            self.failures = 0 if ok else self.failures + 1
            if self.failures >= self.m.breaker_failures:
                self.open = True


LEARNED_HOSTS = 100_000   # hosts whose pace a worker process remembers across shards (a few MB at most)
YIELD_S = 0.2     # a wait this long, with every busy thread waiting, gives the task's CPU back


class Pacer:
    """A zero-CPU Ray actor (one per ingest run) that download tasks wait on when every thread of
    theirs waits for a host: a task blocked in ray.get gives its CPU back to Ray, which runs another
    shard meanwhile, so pacing never holds a CPU for nothing."""

    async def wait(self, seconds: float) -> None:
        import asyncio

        await asyncio.sleep(max(0.0, seconds))


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

    def __init__(self, manners: Manners, learned: "Hosts | None" = None, yield_wait=None):
        self.manners = manners
        # `yield_wait(seconds)`: a wait that gives the task's CPU back meanwhile (a Ray task blocked in
        # ray.get does); used when every busy thread would be waiting, for YIELD_S or longer
        self.yield_wait = yield_wait
        self.yielding = 0
        self.yielded = 0.0
        # a Condition: threads waiting for a host wait on it (see _sleep)
        self.lock = threading.Condition(threading.Lock())
        self.hosts: dict[str, Host] = {}
        # the paces an earlier shard of this process learned, under the same manners: a host that
        # answered quickly starts where it got to, one that pushed back where it was pushed to
        self.learned: dict[str, tuple[float, bool]] = {}
        if learned is not None and learned.manners == manners:
            self.learned = {**learned.learned, **{n: (h.rate, h.pushed_back) for n, h in learned.hosts.items()}}
            for stale in list(self.learned)[: max(0, len(self.learned) - LEARNED_HOSTS)]:   # the oldest first
                del self.learned[stale]
        # pacing's cost: threads downloading, threads asleep waiting for a host, and the seconds when
        # every busy thread was asleep (the task held its CPU and did nothing)
        self.busy = self.asleep = 0
        self.slept = self.idle = 0.0
        self._idle_since: float | None = None

    def get(self, netloc: str) -> Host:
        with self.lock:
            if netloc not in self.hosts:
                host = self.hosts[netloc] = Host(self.manners, netloc, sleep=self._sleep)
                if netloc in self.learned:
                    rate, host.pushed_back = self.learned[netloc]
                    host.rate = min(host.ceiling, max(host.floor, rate))
            return self.hosts[netloc]

    def _count(self, busy: int, asleep: int) -> None:
        """Change the busy/asleep counts (under the lock), closing or opening an all-asleep interval."""
        now = time.monotonic()
        if self._idle_since is not None:
            self.idle += now - self._idle_since
        self.busy += busy
        self.asleep += asleep
        self._idle_since = now if self.busy and self.asleep >= self.busy and not self.yielding else None

    def working(self, delta: int) -> None:
        """A thread starts (+1) or ends (-1) a URL."""
        with self.lock:
            self._count(delta, 0)
            if delta < 0:
                self.lock.notify_all()       # the threads left may all be asleep now: one of them gives the CPU back

    def _may_give_back(self, left: float) -> bool:
        """(Under the lock, the asking thread counted asleep.) Whether its wait of `left` seconds should be
        spent blocked on the pacer: long enough, every busy thread asleep, and no other thread doing so."""
        return (self.yield_wait is not None and left >= YIELD_S and not self.yielding
                and self.busy > 0 and self.asleep >= self.busy)

    def _sleep(self, seconds: float) -> None:
        """Wait `seconds` for a host. A thread waits on the lock's condition, not in time.sleep, so that it
        is woken whenever the task's threads change (one ends its URL, the one giving the CPU back
        returns): if every busy thread is asleep by then, it gives the CPU back for what is left of its
        own wait, instead of holding it idle to the end of a sleep it began while others worked."""
        deadline = time.monotonic() + seconds
        with self.lock:
            self._count(0, 1)
            while (left := deadline - time.monotonic()) > 0:
                if not self._may_give_back(left):
                    self.lock.wait(left)
                    continue
                self.yielding += 1
                self._count(0, 0)                  # the all-asleep interval closes: the CPU is given back
                self.lock.release()
                try:
                    self.yield_wait(left)
                finally:
                    self.lock.acquire()
                    self.yielding -= 1
                    self.yielded += left
                    self._count(0, 0)
                    self.lock.notify_all()         # another thread still waiting may give it back now
            self._count(0, -1)
            self.slept += seconds

    def pacing(self) -> dict:
        """Seconds threads slept waiting for a host, the seconds all busy threads slept at once, and
        the hosts paced slowest now: what politeness cost this task."""
        with self.lock:
            idle = self.idle + (time.monotonic() - self._idle_since if self._idle_since is not None else 0.0)
            # the hosts that pushed back (429/503) or answered slowly enough to be eased below the starting
            # pace, at the pace they ended at, for the cluster (this task's share times the tasks sharing it)
            share = max(1, self.manners.share)
            slow = sorted(((h.rate * share, n) for n, h in self.hosts.items()
                           if h.pushed_back or h.rate < min(self.manners.rate, h.ceiling)), key=lambda x: x[0])
            return {"thread_s": round(self.slept, 3), "idle_s": round(idle, 3), "yielded_s": round(self.yielded, 3),
                    "rates": {n: round(r, 2) for r, n in slow[:10]}}

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
                    delay = _crawl_delay(parser, self.manners.token)
                    if delay:
                        host.crawl_delay(delay)
                elif status is not None and 400 <= status < 500:
                    parser.parse([])                       # no robots.txt: everything allowed
                else:
                    parser.disallow_all = True
                    host.robots_note = host.robots_note or f"robots.txt answered HTTP {status}"
                host.robots = parser
        if host.robots.can_fetch(self.manners.token, url):
            return True, ""
        return False, host.robots_note or "robots.txt disallows it"


def _crawl_delay(parser: urllib.robotparser.RobotFileParser, token: str) -> float | None:
    """Seconds between requests robots.txt asks of `token`: Crawl-delay, or Request-rate's interval."""
    try:
        delay = parser.crawl_delay(token)
        rate = parser.request_rate(token)
    except (AttributeError, TypeError, ValueError):
        return None
    seconds = float(delay) if delay else 0.0
    if rate is not None and rate.requests:
        seconds = max(seconds, rate.seconds / rate.requests)
    return seconds or None
