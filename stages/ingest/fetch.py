"""Safe fetching for img2dataset's Downloader.

img2dataset reads whole responses into memory and follows redirects anywhere, and its decoder sees
a decompression bomb only after allocating it. capline's ingest therefore replaces the module's
`download_image` (importing this module does it, in every process that unpickles a
`SafeDownloader`) with one that:

- refuses non-http(s) schemes and hosts whose addresses are not globally routable (`not
  is_global`: private, loopback, link-local, carrier-grade NAT, 6to4/NAT64/Teredo/IPv4-mapped
  forms of those, cloud metadata), at every redirect hop, unless the host:port is allowed;
- connects to exactly the address it checked (the connection is pinned to it: a DNS answer that
  changes between the check and the connect, "DNS rebinding", changes nothing);
- bounds each URL by an overall deadline (connect, headers and body together), so a server that
  trickles a byte at a time is dropped (`deadline_exceeded`), and stops reading after `max_bytes`;
- decodes only the formats a pretraining image can be (`formats`: JPEG, PNG, WebP, GIF, BMP, TIFF
  by default; never EPS, which runs Ghostscript), reads the header to refuse more than
  `max_pixels` before anything is decoded, and decodes under a per-process budget of pixels in
  flight (`pixels_in_flight`), so a task's decode memory is at most ~4 bytes x that budget
  whatever its 32 threads fetch; then decodes once to catch corrupt and truncated files (cv2, used
  by img2dataset's resizer, silently fills a truncated JPEG with grey).

Every refusal comes back as an error string `capline:<reason>: <detail>` that img2dataset records
in its per-shard parquet and the ingest stage turns into a ledger reason.
"""
from __future__ import annotations

import functools
import http.client
import io
import ipaddress
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass

from infra.media import FORMATS, ImageRefused, _failure, open_checked
from infra.remote import Gone, ask, get

from .img2dataset_parts import prepare
from .resize import Decoded, decode_for_resize
from .polite import Hosts, Manners, retry_after

prepare()   # img2dataset's downloader without its command's imports (img2dataset_parts.py)
import img2dataset.downloader as _i2d  # noqa: E402

METADATA_HOSTS = {"metadata.google.internal", "metadata", "instance-data"}
# special-purpose blocks refused whole (Python's is_global leaves a few of their addresses global;
# 3.11.7 counts as global the IPv6 ones below: IPv4-compatible ::/96, IPv4-mapped ::ffff:0:0/96 (its
# unusual spellings), IPv4-translated ::ffff:0:0:0/96, local-use NAT64 64:ff9b:1::/48 and deprecated
# site-local fec0::/10, all of which reach private hosts)
NOT_PUBLIC = [ipaddress.ip_network(n) for n in ("192.0.0.0/24", "100.64.0.0/10", "198.18.0.0/15", "::/96",
                                                "::ffff:0:0/96", "::ffff:0:0:0/96", "64:ff9b:1::/48", "fec0::/10")]
# cloud instance metadata services: AWS, GCP and Azure (169.254.169.254), AWS's over IPv6, Alibaba Cloud's
METADATA_ADDRS = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254"),
                  ipaddress.ip_address("100.100.100.200")}


@dataclass(frozen=True)
class FetchPolicy:
    allow_hosts: tuple[str, ...] = ()   # "host:port" or "host" that skip the address check
    max_bytes: int = 20_000_000
    max_pixels: int = 50_000_000
    deadline: float = 60.0              # seconds per URL, connect + headers + body, every hop
    formats: tuple[str, ...] = FORMATS  # what PIL may open
    pixels_in_flight: int = 100_000_000  # decoded at once per process (>= max_pixels)
    manners: Manners = Manners()        # per-host politeness (stages/ingest/polite.py)
    own_hosts: tuple[str, ...] = ()     # "host:port" capline itself serves (the demo site): no manners needed
    resize: tuple[str, int] | None = None   # (resize_mode, image_size) the image is decoded for (resize.py)


class PixelBudget:
    """At most `capacity` pixels being decoded at once in this process; a decode waits its turn."""

    def __init__(self, capacity: int):
        self.capacity, self.used, self.peak = capacity, 0, 0
        self.cond = threading.Condition()

    def take(self, n: int) -> "PixelBudget":
        with self.cond:
            self.cond.wait_for(lambda: self.used + n <= self.capacity or self.used == 0)
            self.used += n
            self.peak = max(self.peak, self.used)
        return self

    def give(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


_budget = PixelBudget(FetchPolicy().pixels_in_flight)


_policy = FetchPolicy()
_hosts = Hosts(_policy.manners)


class Refused(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"capline:{reason}: {detail}")


def _embedded_v4(addr) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (IPv4-mapped, 6to4, Teredo's client, NAT64), if any."""
    if addr.version != 6:
        return None
    if addr.ipv4_mapped:
        return addr.ipv4_mapped
    if addr.sixtofour:
        return addr.sixtofour
    if addr.teredo:
        return addr.teredo[1]
    if addr in ipaddress.ip_network("64:ff9b::/96"):
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return None


def address_refusal(addr) -> str | None:
    """Why a connection to `addr` is refused ("metadata_address", "private_address"), or None."""
    for a in (addr, _embedded_v4(addr)):
        if a is None:
            continue
        if a in METADATA_ADDRS:
            return "metadata_address"
        if not a.is_global or a.is_multicast or any(a in net for net in NOT_PUBLIC if net.version == a.version):
            return "private_address"
    return None


# The address each (host, port) was checked to have, per thread: the connection goes there and
# nowhere else (the name is not looked up again), whatever a resolver answers by then.
_pins = threading.local()


def _pinned() -> dict:
    if not hasattr(_pins, "map"):
        _pins.map = {}
    return _pins.map


def check_url(url: str, policy: FetchPolicy) -> str:
    """Raise Refused unless `url` may be fetched under `policy`; -> the address to connect to,
    which is also pinned for this thread's next connection to that host and port."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise Refused("unsafe_url:scheme", parts.scheme or "no scheme")
    host = parts.hostname
    if not host:
        raise Refused("malformed_url", url[:200])
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise Refused("malformed_url", f"bad port in {url[:200]}") from None
    allowed = f"{host}:{port}" in policy.allow_hosts or host in policy.allow_hosts
    if host.lower() in METADATA_HOSTS and not allowed:
        raise Refused("unsafe_url:metadata_address", host)
    try:
        addrs = [ipaddress.ip_address(host)]  # a literal address needs no lookup
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as err:  # OSError: also a network guard refusing the lookup
            raise Refused("dns_error", f"{host}: {err}") from None
        addrs = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addrs:
        raise Refused("dns_error", f"{host}: no address")
    if not allowed:
        for addr in addrs:
            why = address_refusal(addr)
            if why:
                raise Refused(f"unsafe_url:{why}", f"{host} -> {addr}")
    _pinned()[(host.lower(), port)] = str(addrs[0])
    return str(addrs[0])


class _PinnedConnection:
    """http.client's connection, made to the checked address of its host, not a fresh lookup; the
    socket is recorded so the URL's deadline can cut it."""

    def _pinned_create(self, address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, source_address=None, **kw):
        host, port = address
        ip = _pinned().get((str(host).lower().strip("[]"), port))
        if ip is None:
            raise Refused("unsafe_url:unchecked_address", f"{host}:{port} was not checked before connecting")
        sock = socket.create_connection((ip, port), timeout, source_address)
        if sock.getpeername()[0].split("%")[0] != ip:
            sock.close()
            raise Refused("unsafe_url:private_address", f"{host} connected to {sock.getpeername()[0]}, not {ip}")
        sockets = getattr(_pins, "sockets", None)
        if sockets is not None:
            sockets.append(sock)
        return sock


class _PinnedHTTP(_PinnedConnection, http.client.HTTPConnection):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._create_connection = self._pinned_create


class _PinnedHTTPS(_PinnedConnection, http.client.HTTPSConnection):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._create_connection = self._pinned_create   # TLS still names (and verifies) the host


class _PinnedHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_PinnedHTTP, req)


class _PinnedHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(_PinnedHTTPS, req, context=self._context)


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        check_url(newurl, _policy)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _NoProxy(urllib.request.ProxyHandler):
    def __init__(self):
        super().__init__({})    # a proxy would connect elsewhere than the pinned address


_opener = urllib.request.build_opener(_NoProxy, _CheckedRedirects, _PinnedHTTPHandler, _PinnedHTTPSHandler)


def check_image(data: bytes, policy: FetchPolicy, budget: PixelBudget | None = None) -> io.BytesIO:
    """Refuse formats outside the policy, images over the pixel cap (from the header alone) and
    files that do not decode fully; decode within the process's budget of pixels in flight.
    -> the download as the resizer reads it: its bytes and, where this decode serves the resize
    (stages/ingest/resize.py), its pixels, which hold their share of the budget until dropped."""
    budget = budget or _budget
    try:
        img = open_checked(data, policy.formats, policy.max_pixels)
    except ImageRefused as err:
        raise Refused(err.reason, err.detail) from None
    w, h = img.size
    budget.take(w * h)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pixels = decode_for_resize(img, policy.resize)
    except Exception as err:  # noqa: BLE001
        budget.give(w * h)
        refusal = _failure(err)
        raise Refused(refusal.reason, refusal.detail) from None
    finally:
        del img
    if pixels is None:
        budget.give(w * h)
        return io.BytesIO(data)
    held = pixels.shape[0] * pixels.shape[1]     # a reduced decode holds less than it was given
    budget.give(w * h - held)
    return Decoded(data, pixels, (w, h), release=functools.partial(budget.give, held))


class _SlowDown(Exception):
    """The server said 429 or 503: wait (its Retry-After) and ask again, politely."""

    def __init__(self, code: int, retry_after: str | None):
        super().__init__(f"HTTP {code}")
        self.code, self.retry_after = code, retry_after


HOST_FAILURES = ("timeout", "connection_refused", "connection_reset", "dns_error", "deadline_exceeded", "http_500",
                 "http_502", "http_504")


def safe_download_image(row, timeout, user_agent_token, disallowed_header_directives):
    """Drop-in for img2dataset.downloader.download_image: same arguments, same return value. Each URL
    is asked of its host politely (stages/ingest/polite.py): robots.txt, a rate (adapting to the host's
    answers) and a concurrency per host, waits on 429/503, a circuit breaker."""
    hosts = _hosts
    hosts.working(+1)
    try:
        return _download_politely(row, timeout, user_agent_token, disallowed_header_directives)
    finally:
        hosts.working(-1)


def _download_politely(row, timeout, user_agent_token, disallowed_header_directives):
    key, url = row
    try:
        check_url(url, _policy)      # pinned: the first attempt connects to the address checked here
    except Refused as err:
        _pinned().clear()
        return key, None, str(err)
    global _hosts
    m = _policy.manners
    if _hosts.manners != m:        # the policy changed under us (a test, a new downloader)
        _hosts = Hosts(m)
    parts = urllib.parse.urlsplit(url)
    if parts.netloc in _policy.own_hosts:
        try:
            return _fetch_once(key, url, timeout, m.token, disallowed_header_directives, checked=True)
        except _SlowDown as slow:   # capline's own server does not rate-limit; if it did, say so
            return key, None, f"HTTP Error {slow.code}: asked to slow down"
    host = _hosts.get(parts.netloc)
    if host.spent:
        _pinned().clear()
        return key, None, _spent(host, parts.hostname, m)
    if host.open:
        _pinned().clear()
        return key, None, (f"capline:host_unavailable: {parts.hostname} failed {m.breaker_failures} times in a row; "
                           "not asked again by this task")
    allowed, why = _hosts.robots_allow(host, parts.scheme, parts.netloc, url, lambda u: _fetch_small(u, timeout))
    if not allowed:
        _pinned().clear()
        return key, None, f"capline:robots_disallowed: {why}"
    for attempt in range(m.retries + 1):
        if host.take_slot() is None:
            _pinned().clear()
            return key, None, _spent(host, parts.hostname, m)
        asked = time.monotonic()
        try:
            result = _fetch_once(key, url, timeout, m.token, disallowed_header_directives, checked=attempt == 0)
            host.answered(time.monotonic() - asked)
        except _SlowDown as slow:
            wait = retry_after(slow.retry_after, attempt)
            if wait > m.max_wait:
                host.outcome(False)
                return key, None, (f"capline:rate_limited: HTTP {slow.code} asking to wait {wait:.0f}s, more than "
                                   f"max_retry_after {m.max_wait:g}s")
            if host.waited + wait > m.wait_budget:    # a host that only ever says "later" costs a bounded time
                host.spent = True
                host.outcome(False)
                return key, None, (f"capline:rate_limited: {parts.hostname} asked to wait {host.waited + wait:.0f}s in "
                                   f"all, more than stages.ingest.host_wait_budget {m.wait_budget:g}s")
            host.pause(wait)
            continue
        finally:
            host.give_slot()
        reason = reason_of("success" if result[1] is not None else "failed", result[2])
        host.outcome(reason not in HOST_FAILURES)
        return result
    host.outcome(False)      # a 429/503 storm counts toward the host's breaker like any other failure
    return key, None, f"capline:rate_limited: HTTP 429/503 {m.retries + 1} times (waited as asked each time)"


def _spent(host, hostname: str, m) -> str:
    """Why a host this task gave up waiting on gets no more requests from it."""
    if isinstance(host.spent, str):
        return f"capline:rate_limited: {hostname}: {host.spent}; not asked again by this task"
    return (f"capline:rate_limited: {hostname} asked to wait {host.waited:.0f}s in all, more than "
            f"stages.ingest.host_wait_budget {m.wait_budget:g}s; not asked again by this task")


def _fetch_small(url: str, timeout: float, limit: int = 512 << 10) -> tuple[int, bytes]:
    """A small file (robots.txt) through the same checked, pinned opener: -> (status, body). The whole
    exchange (connect, headers, body) is under the URL deadline, as an image's is: a server that
    trickles it a byte at a time is cut off there (the caller then counts it unreachable: disallow),
    where a socket timeout alone would wait as long as bytes keep coming, with every URL of the host
    waiting behind it."""
    _pins.sockets = []
    start = time.monotonic()
    ticket = _watchdog.watch(start + _policy.deadline, _pins.sockets)
    try:
        check_url(url, _policy)
        request = urllib.request.Request(url, headers={"User-Agent": _policy.manners.user_agent})
        with _opener.open(request, timeout=timeout) as r:
            chunks, n = [], 0
            while n < limit:
                chunk = r.read(min(1 << 14, limit - n))
                if not chunk:
                    break
                chunks.append(chunk)
                n += len(chunk)
                if time.monotonic() - start > _policy.deadline:
                    raise TimeoutError(f"not read within {_policy.deadline:g}s")
            if time.monotonic() - start > _policy.deadline:
                raise TimeoutError(f"not read within {_policy.deadline:g}s")
            return r.status, b"".join(chunks)
    except urllib.error.HTTPError as err:
        return err.code, b""
    except OSError:
        if time.monotonic() - start >= _policy.deadline:
            raise TimeoutError(f"not read within {_policy.deadline:g}s") from None
        raise
    finally:
        _watchdog.release(ticket)
        _pins.sockets = None


def _fetch_once(key, url, timeout, user_agent_token, disallowed_header_directives, checked: bool = False):
    """One attempt at `url`; `checked`: its address was checked and pinned just before."""
    _pins.sockets = []
    start = time.monotonic()
    ticket = _watchdog.watch(start + _policy.deadline, _pins.sockets)
    try:
        if not checked:
            check_url(url, _policy)
        request = urllib.request.Request(url, headers={"User-Agent": _policy.manners.user_agent})
        try:
            with _opener.open(request, timeout=timeout) as r:
                if disallowed_header_directives and _i2d.is_disallowed(
                        r.headers, user_agent_token, disallowed_header_directives):
                    return key, None, "capline:robots_disallowed: X-Robots-Tag"
                length = r.headers.get("Content-Length")
                if length and length.isdigit() and int(length) > _policy.max_bytes:
                    raise Refused("too_many_bytes", f"Content-Length {length} > max_bytes {_policy.max_bytes}")
                chunks, n = [], 0
                while n <= _policy.max_bytes:
                    chunk = r.read(min(1 << 16, _policy.max_bytes + 1 - n))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    n += len(chunk)
                    if time.monotonic() - start > _policy.deadline:
                        raise OSError("deadline")
                data = b"".join(chunks)
                if len(data) > _policy.max_bytes:
                    raise Refused("too_many_bytes", f"more than max_bytes {_policy.max_bytes}")
                ctype = (r.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        except Refused:
            raise
        except urllib.error.HTTPError as err:
            if err.code in (429, 503):
                raise _SlowDown(err.code, err.headers.get("Retry-After")) from None
            raise
        except Exception:
            if time.monotonic() - start >= _policy.deadline:
                raise Refused("deadline_exceeded", f"not fetched within {_policy.deadline:g}s "
                                                   "(connect, headers and body)") from None
            raise
        _watchdog.release(ticket)
        if time.monotonic() - start >= _policy.deadline:
            # the watchdog cut the connection mid-headers or mid-body and the reader took what came
            # as a whole (short) response: the URL ran out of time, the image is not at fault
            raise Refused("deadline_exceeded", f"not fetched within {_policy.deadline:g}s (connect, headers and body)")
        try:
            stream = check_image(data, _policy)
        except Refused as err:
            # Servers mislabel images often, so the type only names the failure, never causes it.
            if "undecodable_image" in str(err) and ctype and not ctype.startswith("image/"):
                raise Refused("not_an_image", f"Content-Type {ctype}") from None
            raise
        return key, stream, None
    except _SlowDown:
        raise
    except Refused as err:
        return key, None, str(err)
    except Exception as err:  # noqa: BLE001 - every failure becomes the sample's recorded reason
        return key, None, str(err) or type(err).__name__
    finally:
        _watchdog.release(ticket)
        _pins.sockets = None
        _pinned().clear()


class _Watchdog:
    """One thread per process that ends the connections of every URL past its deadline, whatever
    read they are blocked in (a timer thread per URL would cost a thread start per download)."""

    def __init__(self, period: float = 0.2):
        self.period, self.lock, self.active, self.next, self.thread = period, threading.Lock(), {}, 0, None

    def watch(self, deadline: float, sockets: list) -> int:
        with self.lock:
            self.next += 1
            self.active[self.next] = (deadline, sockets)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="capline-fetch-deadline", daemon=True)
                self.thread.start()
            return self.next

    def release(self, ticket: int) -> None:
        with self.lock:
            self.active.pop(ticket, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.period)
            now = time.monotonic()
            with self.lock:
                late = [self.active.pop(t)[1] for t, (d, _) in list(self.active.items()) if d <= now]
            for sockets in late:
                for sock in list(sockets):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass


_watchdog = _Watchdog()


class SafeDownloader(_i2d.Downloader):
    """img2dataset's Downloader with capline's fetch policy applied in whichever process runs it."""

    def __init__(self, *args, policy: FetchPolicy, **kwargs):
        super().__init__(*args, **kwargs)
        self.policy = policy

    def download_shard(self, row):
        global _policy, _budget, _hosts
        if _policy != self.policy:
            _policy, _budget = self.policy, PixelBudget(self.policy.pixels_in_flight)
        # per shard task: its breakers and report; the paces hosts reached in this process's earlier shards carry over
        _hosts = Hosts(self.policy.manners, learned=_hosts, yield_wait=_yield_wait if _pacer is not None else None)
        return super().download_shard(row)


_pacer = None     # the run's polite.Pacer actor, set by the shard task (None outside Ray: waits sleep)


def wait_on(pacer) -> None:
    """Waits that would hold this task's CPU idle are spent blocked on `pacer` (polite.Pacer)."""
    global _pacer
    _pacer = pacer


def _yield_wait(seconds: float) -> None:
    """Wait `seconds` blocked in ray.get, which gives the task's CPU back to Ray; if the pacer is gone,
    sleep what is left."""
    end = time.monotonic() + seconds
    try:
        ask(_pacer, "wait", seconds, timeout=seconds + 30)
    except Exception:  # noqa: BLE001 - the pacer lost with its node: the wait still happens, holding the CPU
        pass
    left = end - time.monotonic()
    if left > 0:
        time.sleep(left)


def pacing() -> dict:
    """What waiting for hosts cost the last shard in this process (polite.Hosts.pacing)."""
    return _hosts.pacing()


def throttled() -> dict:
    """The hosts of the last shard that asked this process to slow down: {host: [times, seconds waited]}."""
    return {h: [st.slowdowns, round(st.waited, 1)] for h, st in sorted(_hosts.hosts.items()) if st.slowdowns}


# failures that may clear if asked again (`stages.ingest.retries`); anything else is an answer: a
# refusal (robots.txt, X-Robots-Tag, an unsafe address, a host's breaker), a rate limit already waited
# on as the host asked (capline:rate_limited), a 4xx, a file that is not a usable image
TRANSIENT = frozenset(HOST_FAILURES) | {"download_error"}


class _Finished:
    """URLs this process finished, sent to the run's progress counter (a Ray actor) every second by
    one thread: the driver shows URLs done and an ETA while a shard is still downloading."""

    def __init__(self):
        self.lock, self.n, self.sent, self.counter, self.thread = threading.Lock(), 0, 0, None, None

    def report_to(self, counter) -> None:
        with self.lock:
            self.counter, self.n, self.sent = counter, 0, 0
            if counter is not None and (self.thread is None or not self.thread.is_alive()):
                self.thread = threading.Thread(target=self._run, name="capline-fetch-progress", daemon=True)
                self.thread.start()

    def one(self) -> None:
        with self.lock:
            self.n += 1

    def flush(self) -> None:
        with self.lock:
            counter, delta = self.counter, self.n - self.sent
            self.sent = self.n
        if counter is not None and delta:
            try:
                counter.add.remote(delta)
            except Exception:  # noqa: BLE001 - progress is a courtesy: never the download's failure
                pass

    def _run(self) -> None:
        while True:
            time.sleep(1.0)
            self.flush()


_finished = _Finished()


class _Repeats:
    """URLs a shard names more than once: the first row's download (its bytes or its failure) is
    every such row's, and the host is asked once. The shard task says which URLs repeat before it
    downloads (`expect`) and forgets them after (`clear`), so only their results are held.

    `shared`: URLs other shards of the run name too (stages/ingest/shared_urls.py): the thread that fetches
    one for this shard first claims it from the run's `registry`; if another shard's thread holds it,
    this one waits (up to `wait_s`) for that result instead of asking the host again."""

    def __init__(self):
        self.lock = threading.Lock()
        self.urls: frozenset = frozenset()
        self.done: dict[str, tuple] = {}        # url -> (bytes or None, error)
        self.busy: dict[str, threading.Event] = {}
        self.shared: frozenset = frozenset()
        self.registry = None
        self.wait_s = 0.0

    def expect(self, urls, shared=(), registry=None, wait_s: float = 0.0) -> None:
        with self.lock:
            self.urls, self.done, self.busy = frozenset(urls), {}, {}
            self.shared, self.registry, self.wait_s = frozenset(shared), registry, wait_s

    def clear(self) -> None:
        self.expect(())

    def _across(self, row, fetch):
        """A URL other shards name: another thread's result if one is (being) fetched, else ours, told."""
        key, url = row
        deadline = time.monotonic() + self.wait_s
        try:
            while True:
                state, ref = ask(self.registry, "claim", url)
                if state == "done":
                    data, err = get(ref[0])
                    return key, (io.BytesIO(data) if data is not None else None), err
                if state == "mine":
                    break
                if time.monotonic() > deadline:      # its claimant went quiet (a worker gone): fetch it here
                    return fetch(row)
                time.sleep(0.2)
        except Gone:     # the registry is gone (its node with it): fetch it here
            return fetch(row)
        got_key, stream, err = fetch(row)
        data = stream.getvalue() if stream is not None else None
        try:
            ask(self.registry, "finish", url, data, err)
        except Gone:
            pass
        return got_key, (io.BytesIO(data) if data is not None else None), err

    def fetch(self, row, fetch):
        key, url = row
        if url in self.shared and self.registry is not None:
            fetch = functools.partial(self._across, fetch=fetch)
        if url not in self.urls:
            return fetch(row)
        while True:
            with self.lock:
                if url in self.done:
                    data, err = self.done[url]
                    return key, (io.BytesIO(data) if data is not None else None), err
                event = self.busy.get(url)
                if event is None:
                    event = self.busy[url] = threading.Event()
                    break
            event.wait()           # another thread is fetching it: its result is this row's
        try:
            got_key, stream, err = fetch(row)
            data = stream.getvalue() if stream is not None else None
            with self.lock:
                self.done[url] = (data, err)
            return got_key, (io.BytesIO(data) if data is not None else None), err
        finally:
            with self.lock:
                self.busy.pop(url, None)
            event.set()


repeats = _Repeats()


def safe_download_image_with_retry(row, timeout, retries, user_agent_token, disallowed_header_directives):
    try:
        return repeats.fetch(row, lambda r: _download_with_retry(r, timeout, retries, user_agent_token,
                                                                 disallowed_header_directives))
    finally:
        _finished.one()


def _download_with_retry(row, timeout, retries, user_agent_token, disallowed_header_directives):
    """Drop-in for img2dataset's download_image_with_retry, which asks again after any failure: here
    only after a transient one, so a host that refused or asked to slow down is not asked again, and
    the ledger's detail counts the attempts made."""
    for attempt in range(retries + 1):
        key, stream, err = safe_download_image(row, timeout, user_agent_token, disallowed_header_directives)
        if stream is not None or reason_of("failed", err) not in TRANSIENT:
            return key, stream, err
    return key, None, (f"{err} ({retries + 1} attempts)" if retries else err)


# Replace the module functions the Downloader calls.
_i2d.download_image = safe_download_image
_i2d.download_image_with_retry = safe_download_image_with_retry


@dataclass(frozen=True)
class Failure:
    """A download's failure as the ledger records it: a countable reason and a detail that is the same
    on every run. img2dataset carries only an error string from the fetcher to its parquet, so a
    refusal travels as `capline:<reason>: <detail>` (Refused) and is read back here, in the module
    that wrote it; no other module parses it."""
    reason: str
    detail: str


def failure_of(status: str, error: str | None) -> Failure:
    """img2dataset's status and error text for a failed URL -> its Failure."""
    text = re.sub(r"^capline:[a-z_]+: ", "", error or "")
    text = re.sub(r"<([\w.]+) object at 0x[0-9a-fA-F]+>", r"<\1>", text)   # no object addresses
    return Failure(reason_of(status, error) or "download_error", text[:300])


def reason_of(status: str, error: str | None) -> str:
    """Turn img2dataset's status and error text into a short, countable ledger reason."""
    if status == "success":
        return ""
    err = (error or "").strip()
    low = err.lower()
    if err.startswith("capline:"):
        return err[len("capline:"):].split(": ", 1)[0]
    if low.startswith("http error"):
        code = low.split()[2].rstrip(":")
        return f"http_{code}"
    if "timed out" in low or "timeout" in low:
        return "timeout"
    if "connection refused" in low:
        return "connection_refused"
    if "connection reset" in low or "remote end closed" in low:
        return "connection_reset"
    if "name or service not known" in low or "nodename nor servname" in low:
        return "dns_error"
    if "image too small" in low:
        return "image_too_small"
    if "image area too large" in low:
        return "image_too_large"
    if "aspect ratio too large" in low:
        return "aspect_ratio_too_large"
    if "decoding error" in low:
        return "undecodable_image"
    return "download_error"


def recheck(urls: list[str], policy: FetchPolicy, token: str, directives: tuple[str, ...], timeout: float,
            threads: int = 16, progress=None) -> dict[str, str]:
    """Each URL asked again whether it may be used, as politely as a download: robots.txt once per
    host, then a HEAD whose X-Robots-Tag is read, within the host's rate and concurrency; hosts in
    parallel; each URL told to `progress` (a counter) once answered. -> url -> why it opts out now,
    or "" when it does not (a URL or robots.txt that does not answer is no opt-out: `unreachable:
    ...`, recorded, not removed)."""
    from concurrent.futures import ThreadPoolExecutor

    global _policy, _budget, _hosts
    if _policy != policy:
        _policy, _budget = policy, PixelBudget(policy.pixels_in_flight)
    _hosts = Hosts(policy.manners)

    def one(url: str) -> str:
        try:
            return ask(url)
        finally:
            _finished.one()

    def ask(url: str) -> str:
        try:
            check_url(url, _policy)
        except Refused as err:
            _pinned().clear()
            return f"unreachable: {err}"
        parts = urllib.parse.urlsplit(url)
        host = _hosts.get(parts.netloc)
        allowed, why = _hosts.robots_allow(host, parts.scheme, parts.netloc, url, lambda u: _fetch_small(u, timeout))
        if not allowed:
            # a robots.txt that did not answer stops a crawl (RFC 9309), but says nothing of what a
            # site wants taken out of published data: counted, never removed for it
            return f"unreachable: {why}" if getattr(host, "robots_note", None) else f"robots_disallowed: {why}"
        if host.spent or host.take_slot() is None:
            return f"unreachable: {_spent(host, parts.hostname, _policy.manners)[len('capline:'):]}"
        _pins.sockets = []
        start = time.monotonic()
        ticket = _watchdog.watch(start + _policy.deadline, _pins.sockets)
        try:
            check_url(url, _policy)
            request = urllib.request.Request(url, method="HEAD", headers={"User-Agent": _policy.manners.user_agent})
            with _opener.open(request, timeout=timeout) as r:
                if time.monotonic() - start >= _policy.deadline:
                    # the watchdog cut the headers short and the reader took what came as all of them:
                    # a header that says "opt out" may be among those never read
                    return f"unreachable: no answer within {_policy.deadline:g}s"
                if directives and _i2d.is_disallowed(r.headers, token, list(directives)):
                    return "robots_disallowed: X-Robots-Tag"
            return ""
        except urllib.error.HTTPError as err:
            if err.code in (401, 403, 404, 410, 451) and directives and _i2d.is_disallowed(err.headers, token, list(directives)):
                return "robots_disallowed: X-Robots-Tag"
            return f"unreachable: HTTP {err.code}"
        except Exception as err:  # noqa: BLE001 - no answer is not an opt-out
            return f"unreachable: {type(err).__name__}"
        finally:
            _watchdog.release(ticket)
            _pins.sockets = None
            _pinned().clear()
            host.give_slot()

    by_host: dict[str, list[str]] = {}
    for u in urls:
        by_host.setdefault(urllib.parse.urlsplit(u).netloc, []).append(u)
    # URLs interleaved across hosts: every thread busy while each host's own limits hold
    order = [u for group in _interleave(list(by_host.values())) for u in group]
    _finished.report_to(progress)
    try:
        with ThreadPoolExecutor(max(1, min(threads, len(order)))) as pool:
            return dict(zip(order, pool.map(one, order)))
    finally:
        _finished.flush()


def _interleave(groups: list[list[str]]) -> list[list[str]]:
    out, i = [], 0
    while any(i < len(g) for g in groups):
        out.append([g[i] for g in groups if i < len(g)])
        i += 1
    return out
