"""Unit: URL safety, image checks and error-to-reason mapping of the safe fetcher."""
import io
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from stages.ingest.polite import Manners
from stages.ingest.fetch import FetchPolicy, Refused, check_image, check_url, reason_of, safe_download_image
from stages.source.synthetic import png_bomb

POLICY = FetchPolicy(max_bytes=10_000, max_pixels=1_000_000)


def _reason(fn, *args):
    with pytest.raises(Refused) as err:
        fn(*args)
    return str(err.value).split(": ")[0].removeprefix("capline:")


@pytest.mark.parametrize("url,reason", [
    ("file:///etc/passwd", "unsafe_url:scheme"),
    ("ftp://example.org/x.jpg", "unsafe_url:scheme"),
    ("http://127.0.0.1:8000/x.jpg", "unsafe_url:private_address"),
    ("http://localhost/x.jpg", "unsafe_url:private_address"),
    ("http://10.1.2.3/x.jpg", "unsafe_url:private_address"),
    ("http://192.168.0.1/x.jpg", "unsafe_url:private_address"),
    ("http://[::1]/x.jpg", "unsafe_url:private_address"),
    ("http://169.254.169.254/latest/meta-data/", "unsafe_url:metadata_address"),
    ("http://metadata.google.internal/computeMetadata/v1", "unsafe_url:metadata_address"),
    ("http:///nohost.jpg", "malformed_url"),
    # not globally routable, though the old private/reserved test let them through
    ("http://100.100.100.200/latest/meta-data/", "unsafe_url:metadata_address"),   # Alibaba Cloud's
    ("http://100.64.0.1/x.jpg", "unsafe_url:private_address"),                     # carrier-grade NAT
    ("http://192.0.0.8/x.jpg", "unsafe_url:private_address"),
    ("http://[2002:7f00:1::1]/x.jpg", "unsafe_url:private_address"),               # 6to4 of 127.0.0.1
    ("http://[2002:a9fe:a9fe::1]/x.jpg", "unsafe_url:metadata_address"),           # 6to4 of the metadata IP
    ("http://[::ffff:127.0.0.1]/x.jpg", "unsafe_url:private_address"),             # IPv4-mapped
    ("http://[64:ff9b::a00:1]/x.jpg", "unsafe_url:private_address"),               # NAT64 of 10.0.0.1
    ("http://0.0.0.0/x.jpg", "unsafe_url:private_address"),
    ("http://[ff02::1]/x.jpg", "unsafe_url:private_address"),
    # global by Python 3.11.7's tables, private in fact
    ("http://[::a00:1]/x.jpg", "unsafe_url:private_address"),                      # IPv4-compatible 10.0.0.1
    ("http://[::ffff:0:a00:1]/x.jpg", "unsafe_url:private_address"),               # IPv4-translated
    ("http://[64:ff9b:1::a00:1]/x.jpg", "unsafe_url:private_address"),             # local-use NAT64
    ("http://[fec0::1]/x.jpg", "unsafe_url:private_address"),                      # site-local
])
def test_unsafe_urls_refused_before_any_connection(url, reason):
    assert _reason(check_url, url, POLICY) == reason


def test_allow_list_lets_exactly_that_host_port_through():
    policy = FetchPolicy(allow_hosts=("127.0.0.1:8765",))
    check_url("http://127.0.0.1:8765/img/a.jpg", policy)
    assert _reason(check_url, "http://127.0.0.1:8766/img/a.jpg", policy) == "unsafe_url:private_address"


def _jpeg(w=32, h=32) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_image_checks():
    check_image(_jpeg(), POLICY)
    assert _reason(check_image, png_bomb(2000, 2000), POLICY) == "image_too_large"
    assert _reason(check_image, _jpeg()[:300], POLICY) == "truncated_image"
    assert _reason(check_image, b"\x00garbage" * 50, POLICY) == "undecodable_image"


def test_png_bomb_is_small_on_disk_but_huge_in_pixels():
    data = png_bomb(12000, 12000)
    assert len(data) < 1_000_000
    assert Image.open(io.BytesIO(data)).size == (12000, 12000)


@pytest.mark.parametrize("status,error,reason", [
    ("success", None, ""),
    ("failed_to_download", "HTTP Error 404: Not Found", "http_404"),
    ("failed_to_download", "<urlopen error timed out>", "timeout"),
    ("failed_to_download", "The read operation timed out", "timeout"),
    ("failed_to_download", "<urlopen error [Errno 111] Connection refused>", "connection_refused"),
    ("failed_to_download", "capline:unsafe_url:private_address: x -> 10.0.0.1", "unsafe_url:private_address"),
    ("failed_to_download", "capline:too_many_bytes: more than max_bytes 10", "too_many_bytes"),
    ("failed_to_resize", "image too small", "image_too_small"),
    ("failed_to_resize", "something new", "download_error"),
])
def test_reason_mapping(status, error, reason):
    assert reason_of(status, error) == reason


class _Redirector(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path == "/big":
            body = b"x" * 50_000
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.end_headers()  # no Content-Length: the cap must hold while reading
            self.wfile.write(body)
            return
        if self.path == "/html":
            body = b"<html>hello</html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(302)
        self.send_header("Location", "http://10.9.9.9/secret.jpg")
        self.end_headers()


@pytest.fixture()
def redirector():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Redirector)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_redirect_to_private_address_and_byte_cap(redirector, monkeypatch):
    import stages.ingest.fetch as fetch

    # robots.txt off: this is about where a redirect may lead (tests/stages/test_politeness.py has robots)
    monkeypatch.setattr(fetch, "_policy", FetchPolicy(allow_hosts=(redirector,), max_bytes=10_000,
                                                      manners=Manners(robots=False)))
    _, stream, err = safe_download_image((0, f"http://{redirector}/go"), 3, None, None)
    assert stream is None and reason_of("failed_to_download", err) == "unsafe_url:private_address"
    _, stream, err = safe_download_image((1, f"http://{redirector}/big"), 3, None, None)
    assert stream is None and reason_of("failed_to_download", err) == "too_many_bytes"
    _, stream, err = safe_download_image((2, f"http://{redirector}/html"), 3, None, None)
    assert stream is None and reason_of("failed_to_download", err) == "not_an_image"


class _Counting(BaseHTTPRequestHandler):
    """Counts requests by path; `trickled` is sent a byte every 0.2 s for a minute after its headers
    (each byte beats any socket timeout); anything else is a whole JPEG."""
    hits: list = []
    trickled, trickled_type = "/trickle", "image/png"

    def log_message(self, *a):
        pass

    def do_GET(self):
        import time

        type(self).hits.append(self.path)
        if self.path == "/trickle-headers":      # the status line, then header bytes one at a time
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n")
            for _ in range(300):
                try:
                    self.wfile.write(b"X")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)
            return
        if self.path == self.trickled:
            self.send_response(200)
            self.send_header("Content-Type", self.trickled_type)
            self.end_headers()
            for _ in range(300):
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)
            return
        body = _jpeg()
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def counting():
    _Counting.hits = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield server.server_address[1], _Counting.hits
    server.shutdown()
    server.server_close()


def test_dns_rebinding_connects_only_to_the_checked_address(counting, monkeypatch):
    """The resolver answers a public address for the check, then loopback: the fetch still goes to
    the address it checked (here unreachable), never to the loopback server behind the second answer."""
    import socket

    import stages.ingest.fetch as fetch

    port, hits = counting
    answers = iter(["93.184.216.34", "127.0.0.1", "127.0.0.1", "127.0.0.1"])
    real = socket.getaddrinfo

    def rebinding(host, *args, **kwargs):
        if host == "rebind.example":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]
        return real(host, *args, **kwargs)

    connected = []

    def no_network(address, *args, **kwargs):   # this machine reaches no public address: record it
        connected.append(address[0])
        if address[0] == "127.0.0.1":
            return socket_create(address, *args, **kwargs)
        raise ConnectionRefusedError(f"{address[0]} unreachable here")

    socket_create = socket.create_connection
    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setattr(fetch.socket, "create_connection", no_network)
    monkeypatch.setattr(fetch, "_policy", FetchPolicy(deadline=10, manners=Manners(robots=False)))
    _, stream, err = safe_download_image((0, f"http://rebind.example:{port}/a.jpg"), 3, None, None)
    assert stream is None and err
    assert connected == ["93.184.216.34"] and hits == []


def test_slow_loris_is_dropped_at_the_deadline(counting, monkeypatch):
    import time

    import stages.ingest.fetch as fetch

    port, hits = counting
    monkeypatch.setattr(fetch, "_policy", FetchPolicy(allow_hosts=(f"127.0.0.1:{port}",), deadline=0.5))
    t0 = time.monotonic()
    _, stream, err = safe_download_image((0, f"http://127.0.0.1:{port}/trickle"), 5, None, None)
    assert stream is None and reason_of("failed_to_download", err) == "deadline_exceeded", err
    assert time.monotonic() - t0 < 30     # the server trickles for a minute; each byte beats the 5 s timeout
    _, stream, err = safe_download_image((1, f"http://127.0.0.1:{port}/ok.jpg"), 5, None, None)
    assert stream is not None and err is None


def test_headers_trickled_on_an_image_are_a_deadline_not_an_undecodable_image(counting, monkeypatch):
    """Headers sent a byte at a time: cut at the URL's deadline and named so (it was recorded as
    `undecodable_image`, a failure of the image, so the host's breaker never counted it)."""
    import time

    import stages.ingest.fetch as fetch

    port, hits = counting
    monkeypatch.setattr(fetch, "_policy", FetchPolicy(allow_hosts=(f"127.0.0.1:{port}",), deadline=0.6,
                                                      manners=Manners(robots=False)))
    t0 = time.monotonic()
    _, stream, err = safe_download_image((0, f"http://127.0.0.1:{port}/trickle-headers"), 5, None, None)
    assert stream is None and reason_of("failed_to_download", err) == "deadline_exceeded", err
    assert time.monotonic() - t0 < 30
    assert "deadline_exceeded" in fetch.HOST_FAILURES        # so it counts toward the host's breaker


def _psd(w: int = 4, h: int = 4) -> bytes:
    """A minimal Photoshop file (PIL reads PSD but cannot write it): header, three empty sections,
    raw RGB channels."""
    import struct

    header = b"8BPS" + struct.pack(">H", 1) + b"\0" * 6 + struct.pack(">HIIHH", 3, h, w, 8, 3)
    return header + struct.pack(">III", 0, 0, 0) + struct.pack(">H", 0) + b"\x80" * (w * h * 3)


@pytest.mark.parametrize("fmt", ["EPS", "PCX", "ICO", "PSD"])
def test_formats_outside_the_allow_list_are_refused(fmt):
    buf = io.BytesIO()
    if fmt == "PSD":
        buf.write(_psd())
        assert Image.open(io.BytesIO(_psd())).format == "PSD"     # PIL would decode it
    else:
        Image.new("RGB", (32, 32), (200, 10, 10)).save(buf, fmt)
    with pytest.raises(Refused, match=f"unsupported_format: {fmt}"):
        check_image(buf.getvalue(), POLICY)


def test_png_bombs_under_the_cap_decode_within_the_pixel_budget():
    """7000x7000 (49M pixels, a 0.2 MB file) is allowed by max_pixels 50M; three threads decoding it
    at once with a budget of 60M pixels in flight decode one after another: the budget holds."""
    from stages.ingest.fetch import PixelBudget

    data = png_bomb(7000, 7000)
    assert len(data) < 400_000
    policy = FetchPolicy(max_pixels=50_000_000, pixels_in_flight=60_000_000)
    budget = PixelBudget(policy.pixels_in_flight)
    errors = []

    def decode():
        try:
            check_image(data, policy, budget)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=decode) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and budget.used == 0
    assert budget.peak == 49_000_000 <= policy.pixels_in_flight
    assert _reason(check_image, png_bomb(8000, 8000), policy) == "image_too_large"


class _Answers(BaseHTTPRequestHandler):
    """/noai: an image its server refuses to AI use (X-Robots-Tag: noai); /gone: 404; /flaky: 500.
    Counts every request by path."""
    asked: Counter = Counter()

    def log_message(self, *args):
        pass

    def do_GET(self):
        _Answers.asked[self.path] += 1
        code = {"/noai": 200, "/gone": 404, "/flaky": 500}[self.path]
        body = b"\x89PNG not really" if code == 200 else b"no"
        self.send_response(code)
        self.send_header("Content-Type", "image/png" if code == 200 else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        if self.path == "/noai":
            self.send_header("X-Robots-Tag", "noai")
        self.end_headers()
        self.wfile.write(body)


def test_retries_ask_again_only_after_transient_failures(monkeypatch):
    """stages.ingest.retries asks again after a 500, never after a refusal or a 404 (img2dataset's own
    retry asked again after anything: a host that said no, or asked to slow down, was asked again)."""
    import stages.ingest.fetch as fetch

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    where = f"127.0.0.1:{server.server_address[1]}"
    try:
        monkeypatch.setattr(fetch, "_policy", FetchPolicy(allow_hosts=(where,), manners=Manners(robots=False)))
        _Answers.asked.clear()
        got = {p: fetch.safe_download_image_with_retry((0, f"http://{where}{p}"), 3, 2, "capline", ["noai"])
               for p in ("/noai", "/gone", "/flaky")}
    finally:
        server.shutdown()
        server.server_close()
    assert dict(_Answers.asked) == {"/noai": 1, "/gone": 1, "/flaky": 3}
    assert reason_of("failed", got["/noai"][2]) == "robots_disallowed"
    assert reason_of("failed", got["/gone"][2]) == "http_404"
    assert got["/flaky"][2].endswith("(3 attempts)") and reason_of("failed", got["/flaky"][2]) == "http_500"


class _TrickledRobots(_Counting):
    """robots.txt trickled; images whole."""
    hits: list = []
    trickled, trickled_type = "/robots.txt", "text/plain"


def test_a_trickled_robots_txt_is_cut_at_the_deadline_and_counts_as_disallow(monkeypatch):
    """A host that trickles its robots.txt held every URL of the host behind it indefinitely: now the
    exchange ends at the URL deadline and the host's URLs are refused as robots_disallowed."""
    import time

    import stages.ingest.fetch as fetch

    _TrickledRobots.hits = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TrickledRobots)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    port = server.server_address[1]
    try:
        monkeypatch.setattr(fetch, "_policy", FetchPolicy(allow_hosts=(f"127.0.0.1:{port}",), deadline=1.0))
        monkeypatch.setattr(fetch, "_hosts", fetch.Hosts(fetch._policy.manners))
        t0 = time.monotonic()
        _, stream, err = safe_download_image((0, f"http://127.0.0.1:{port}/a.jpg"), 5, None, None)
        took = time.monotonic() - t0
        _, stream2, err2 = safe_download_image((1, f"http://127.0.0.1:{port}/b.jpg"), 5, None, None)
    finally:
        server.shutdown()
        server.server_close()
    assert stream is None and reason_of("failed", err) == "robots_disallowed" and "unreachable" in err, err
    assert took < 5, took                                   # the deadline, not the minute the server trickles
    assert stream2 is None and reason_of("failed", err2) == "robots_disallowed"
    assert _TrickledRobots.hits == ["/robots.txt"]          # asked once, no image fetched


def test_a_recheck_head_whose_headers_trickle_past_the_deadline_is_unanswered(counting, monkeypatch):
    """recheck's HEAD under the same whole-exchange deadline as a download: headers sent a byte at a
    time (each beats the socket timeout) end as `unreachable`, never as checked."""
    import time

    from stages.ingest.fetch import recheck

    port, hits = counting
    _Counting.do_HEAD = _Counting.do_GET
    try:
        policy = FetchPolicy(allow_hosts=(f"127.0.0.1:{port}",), deadline=0.6, manners=Manners(robots=False))
        t0 = time.monotonic()
        got = recheck([f"http://127.0.0.1:{port}/trickle-headers", f"http://127.0.0.1:{port}/ok.jpg"], policy,
                      "capline", ("noai",), timeout=5)
    finally:
        del _Counting.do_HEAD
    assert got[f"http://127.0.0.1:{port}/ok.jpg"] == ""
    assert got[f"http://127.0.0.1:{port}/trickle-headers"].startswith("unreachable"), got
    assert time.monotonic() - t0 < 10
