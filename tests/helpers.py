"""Helpers the tests import (conftest.py is pytest's; importing it again would run its set-up twice)."""
from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import threading
import time
import signal
import shutil
import subprocess
import tempfile
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


def reply(handler, code: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
    """An http.server handler's whole answer: status, type, length, any other headers, the body."""
    handler.send_response(code)
    handler.send_header("Content-Type", ctype)
    handler.send_header("Content-Length", str(len(body)))
    for k, v in (headers or {}).items():
        handler.send_header(k, v)
    handler.end_headers()
    handler.wfile.write(body)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moto_s3(bucket: str):
    """moto_server on loopback with IAM checks on: an IAM user with S3 rights, whose key is the only
    one accepted, and `bucket` created. A generator: yields (env for a client process, boto3 client),
    and stops the server by pid when closed."""
    import json
    import socket
    import time

    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                              env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline and server.poll() is None, "moto_server did not start"
                time.sleep(0.3)
        admin = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bootstrap",
                     aws_secret_access_key="bootstrap")
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="capline")
        key = iam.create_access_key(UserName="capline")["AccessKey"]
        policy = iam.create_policy(PolicyName="s3-all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        iam.attach_user_policy(UserName="capline", PolicyArn=policy["Policy"]["Arn"])
        env = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
               "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        client.create_bucket(Bucket=bucket)
        yield env, client
    finally:
        server.terminate()
        server.wait(timeout=20)


@contextlib.contextmanager
def s3_behind_proxy(bucket: str, latency: float, **proxy):
    """moto_s3(bucket) with a CountingProxy in front (`proxy`: its write_limit, faults, ...): yields (env
    for a client process, naming the proxy as the endpoint; a boto3 client talking to moto directly;
    the proxy, whose log counts requests); both stopped on leaving."""
    gen = moto_s3(bucket)
    env, client = next(gen)
    counting = CountingProxy(("127.0.0.1", int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])), latency, **proxy).start()
    try:
        yield {**env, "AWS_ENDPOINT_URL": counting.endpoint}, client, counting
    finally:
        counting.shutdown()
        gen.close()


def bucket_keys(client, bucket: str, prefix: str) -> list[str]:
    out, token = [], None
    while True:
        kw = {"Bucket": bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
        page = client.list_objects_v2(**kw)
        out += [o["Key"] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return out
        token = page["NextContinuationToken"]


def chromium_console(page, screenshot, size="1300,3000") -> list[str]:
    """Open `page` headless; -> the console messages it logged. No network: every request goes to a
    proxy that does not exist, and Chromium's background services are off."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        import pytest

        pytest.fail("Debian's chromium is not installed; `make test` installs it (apt, as root)")
    profile = tempfile.mkdtemp(prefix="capline-chromium-")   # a new empty profile every time
    proc = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", f"--user-data-dir={profile}",
         "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-default-apps", "--disable-extensions",
         "--proxy-server=socks5://127.0.0.1:9", "--proxy-bypass-list=<-loopback>", "--enable-logging=stderr",
         "--v=0", f"--window-size={size}", f"--screenshot={screenshot}", f"file://{page}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]


class CountingProxy(http.server.ThreadingHTTPServer):
    """A loopback proxy in front of an object store: forwards every request after `latency` seconds and
    logs (time, method, path, bytes sent, bytes received), so a test or benchmark counts requests."""
    daemon_threads = True

    def __init__(self, upstream: tuple[str, int], latency: float, faults: float = 0.0, seed: int = 0,
                 stall: float = 2.0, write_limit: float | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream, self.latency = upstream, latency
        self.log_lock = threading.Lock()
        self.entries: list[tuple[float, str, str, int, int]] = []
        # write_limit: writes (PUT, POST, DELETE) accepted per second, as S3 limits a prefix; one over
        # it in the last second is answered 503 SlowDown (counted in `slowdowns`) and not forwarded
        from collections import deque

        self.write_limit, self.recent_writes, self.slowdowns = write_limit, deque(), 0
        # faults: this share of requests answered 503 SlowDown or 500, cut (connection reset) or
        # stalled `stall` seconds, chosen by a seeded draw; a request that got a fault is let through
        # when it comes again, as a store's transient faults clear on retry
        import random

        self.faults, self.stall, self.rng = faults, stall, random.Random(seed)
        self.faulted: set[tuple[str, str]] = set()
        self.injected: dict[str, int] = {}

    def over_write_limit(self, method: str) -> bool:
        if self.write_limit is None or method not in ("PUT", "POST", "DELETE"):
            return False
        now = time.monotonic()
        with self.log_lock:
            while self.recent_writes and now - self.recent_writes[0] > 1.0:
                self.recent_writes.popleft()
            if len(self.recent_writes) >= self.write_limit:
                self.slowdowns += 1
                return True
            self.recent_writes.append(now)
            return False

    def fault_for(self, method: str, path: str) -> str | None:
        if not self.faults:
            return None
        with self.log_lock:
            if (method, path) in self.faulted:
                self.faulted.discard((method, path))
                return None
            if self.rng.random() >= self.faults:
                return None
            kind = self.rng.choice(("503", "500", "reset", "stall"))
            self.faulted.add((method, path))
            self.injected[kind] = self.injected.get(kind, 0) + 1
            return kind

    def handle_error(self, request, client_address):
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return   # the client gave up on a response (its SDK retries): not the proxy's error
        super().handle_error(request, client_address)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> "CountingProxy":
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def gets(self, suffix: str = "") -> list[str]:
        with self.log_lock:
            return [p for _, m, p, _, _ in self.entries if m == "GET" and p.endswith(suffix)]


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _fault(self, kind: str) -> bool:
        """Answer with an injected fault; -> True if the request is finished with it."""
        import socket
        import struct

        if kind == "stall":
            time.sleep(self.server.stall)
            return False
        if kind == "reset":   # RST, not FIN: the client sees "connection reset by peer"
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return True
        code, name = ("SlowDown", "Please reduce your request rate.") if kind == "503" else ("InternalError", "We encountered an internal error.")
        body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{name}</Message></Error>".encode()
        self.send_response_only(int(kind), code)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        return True

    def _forward(self):
        body = self._body()
        time.sleep(self.server.latency)
        kind = "503" if self.server.over_write_limit(self.command) else self.server.fault_for(self.command, self.path)
        if kind and self._fault(kind):
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(*self.server.upstream, timeout=120)
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        with self.server.log_lock:
            self.server.entries.append((time.time(), self.command, self.path.split("?")[0], len(body), len(data)))
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)) if self.command != "HEAD" else
                         resp.getheader("Content-Length", "0"))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


CLUSTER_TAG = "CAPLINE_TEST_CLUSTER"


def cluster_tag(env: dict) -> tuple[dict, str]:
    """`env` with a fresh tag that every process of a cluster started with it inherits (GCS, raylets,
    dashboard, workers), so `ray_pids(tag)` finds that cluster's processes and no other's: tests run
    side by side (pytest-xdist), and "every Ray process that is new" would take the other's too."""
    import uuid

    tag = uuid.uuid4().hex
    return {**env, CLUSTER_TAG: tag}, tag


def ray_pids(tag: str) -> set[int]:
    """Pids of the Ray processes (raylets, GCS, dashboards, workers) started with `cluster_tag`'s tag."""
    import psutil

    out = set()
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ray" in cmd and ("raylet" in cmd or "gcs_server" in cmd or "ray/" in cmd or "ray::" in cmd):
            try:
                if p.environ().get(CLUSTER_TAG) == tag:
                    out.add(p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
    return out


def stop_pids(pids: set[int]) -> None:
    """Terminate these processes and their children, by pid; kill what is left after 15 s."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=10)


def synthetic_rows(folder: Path, n: int, seed: int, **defects: float) -> list[dict]:
    """The demo's generator: n captioned scenes under folder/www (served by stages.demo_server),
    none defective except the `defects` fractions given; -> the URL list's rows (url with the
    server placeholder, caption)."""
    import pyarrow.parquet as pq

    from stages.source import synthetic
    from stages.source.stage import DefectFractions

    fractions = {k: 0 for k in vars(DefectFractions())} | defects
    synthetic.generate(folder, n, 10, 48, seed, fractions, 100, 100)
    return pq.read_table(folder / "urls.parquet").to_pylist()


_EVAL_CACHE: list[str] = []


def eval_index_cache() -> str:
    """A folder for `stages.dedup.cache_dir` (evaluation indexes built once and reused), one per test
    process and removed when it ends (each test module made its own and none was removed)."""
    if not _EVAL_CACHE:
        import atexit

        _EVAL_CACHE.append(tempfile.mkdtemp(prefix="capline-eval-index-"))
        atexit.register(shutil.rmtree, _EVAL_CACHE[0], True)
    return _EVAL_CACHE[0]


def write_shard(path: Path, samples: list[dict]) -> list[int]:
    """A shard for a test, with the shard stage's own tar writer (stages/shard/stage.shard_bytes):
    samples [{key, image (bytes), ext, caption, meta (dict)}] -> each sample's offset."""
    import json

    from stages.shard.stage import shard_bytes

    data, offsets = shard_bytes((s["key"], s["image"], s["ext"], s["caption"],
                                 json.dumps(s["meta"], sort_keys=True, ensure_ascii=False)) for s in samples)
    path.write_bytes(data)
    return offsets
