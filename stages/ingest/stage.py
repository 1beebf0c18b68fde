"""The ingest stage: download the URL list with img2dataset into WebDataset shards, and index them.

Each shard is one Ray task: it reads its slice of a source partition from the run folder's storage,
downloads it with img2dataset's own pieces (Downloader with a thread pool, Resizer re-encodes; the
tar + parquet in img2dataset's layout by stages/ingest/img2dataset_parts.py) into the worker's own
temporary folder, moves the files into the run folder, and writes the shard's ledger partition, which is also the sample index:
key -> (tar, member, byte offset, size, sha256, original width and height) that every later stage
reaches images by. The driver gets counts back. capline adds:

- safety (stages/ingest/fetch.py): no private/metadata addresses, capped bytes and pixels;
- completeness: each shard's files are moved into `shards/` only when whole (tar and parquet
  first, `_stats.json` last) and its result (`results/NNNNN.json`) is written after its ledger, so
  a killed ingest never leaves a truncated tar where a later stage would read it, and a rerun
  redoes only the shards without a result;
- a verdict per URL: img2dataset's per-shard parquet keeps failed rows with their error, which
  become ledger reasons (`http_404`, `timeout`, `undecodable_image`, `image_too_large`, ...);
- incremental runs: each source partition downloads into `parts/<partition>-<digest>/`, named by
  its content (the checksum its writer recorded) and this config. Those folders survive a change of
  the stage's input (the runner keeps `preserve` paths), so appending a partition downloads only it.
"""
from __future__ import annotations

import re

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from infra import remote
from infra.configtools import join, require

from .. import records
from . import shared_urls
from ..base import Source, StageContext, StageResult
from ..dataplane import DROPPED, KEPT, SAMPLE_SCHEMA, PartResult, read_kept, write_part
from ..source.stage import safe_name
from ..source.synthetic import SERVER_PLACEHOLDER


# the formats a pretraining image can be; PIL opens ~40 (EPS runs Ghostscript where it is installed)
from infra.media import FORMATS  # noqa: E402 - the one allow-list


@dataclass
class IngestConfig:
    # how the work is cut or run, never what is decided: left out of the fingerprint and the card
    # (host_wait_budget only bounds how long a host that keeps saying "later" is waited on; in the
    # fingerprint it would have renamed every unit's tars and downloaded every list again on upgrade;
    # host_rate_max and host_limits, likewise: how fast hosts are asked, added after runs existed)
    HOW: ClassVar[tuple] = ("compact_rows", "contact", "host_wait_budget", "host_rate_max", "host_limits",
                            "urls_per_worker")
    image_size: int = 256  # img2dataset resizes each image to this many pixels (see resize_mode)
    resize_mode: Literal["border", "keep_ratio", "center_crop", "no"] = "border"  # img2dataset's resize; border pads to a square (dedup and scorers see the picture without the bars)
    encode_format: Literal["jpg", "png", "webp"] = "jpg"  # how resized images are stored in the tars
    encode_quality: int = 95  # JPEG/WebP quality of the stored images
    timeout: float = 10.0            # seconds per request
    retries: int = 1                 # extra attempts per URL
    thread_count: int = 32           # concurrent requests per shard task
    samples_per_shard: int = 1000  # URLs per ingest shard: one download task and one tar each
    # the stages after ingest get partitions of this many samples' worth of consecutive shards of one
    # source partition, whatever the cluster or the data's size: a partition never moves, so another
    # cluster or an append reuses every one. Tasks per later stage ~ samples / compact_rows: 5,000 at
    # 10^8. How the work is cut, not what is decided: not in the fingerprint
    compact_rows: int = 20_000
    min_image_size: int | None = None    # moved: the basic stage decides image_too_small (min_image_side)
    max_aspect_ratio: float | None = None  # moved: the basic stage decides aspect_ratio (max_aspect_ratio)
    max_bytes: int = 20_000_000      # a response longer than this is dropped (too_many_bytes)
    max_pixels: int = 50_000_000     # width x height, checked before decoding (image_too_large)
    allow_hosts: list[str] = field(default_factory=list)  # "host:port" let through the address check
    deadline: float = 60.0           # seconds per URL in all (connect, headers, body, redirects)
    formats: list[str] = field(default_factory=lambda: list(FORMATS))   # PIL formats a download may be
    pixels_in_flight: int = 100_000_000   # decoded at once per task: its decode memory is ~4 B x this
    task_retries: int = 2            # Ray retries of a shard whose worker died
    # URLs a new worker process is started for, at least: its start (Ray's worker, then img2dataset's
    # resizer with albumentations and OpenCV) is ~1.5 s of CPU, the download of ~30-60 URLs (the
    # partitions benchmark spends ~50 ms of CPU per URL). A small run or an append runs on fewer
    # processes than the cluster's CPUs (a 1 % append's 80 URLs ran in 16 new ones, 13 s a shard on 2
    # real cores); raise the parallelism of a short list of slow hosts by lowering it
    urls_per_worker: int = 64
    # politeness per host (stages/ingest/polite.py), for the whole cluster: each download task gets its share
    user_agent_token: str = "capline"    # in the User-Agent; the robots.txt / X-Robots-Tag token honoured
    host_wait_budget: float = 300.0  # seconds of Retry-After a download task grants one host in all; then its URLs are rate_limited
    # who runs the crawl, in the User-Agent (a URL or mail address): site operators ask before they block
    contact: str = ""
    respect_robots: bool = True  # read each host's robots.txt once and honour it for user_agent_token
    # requests per second to one host, cluster-wide, at first: it grows while the host answers within
    # a second (up to host_rate_max, its robots.txt Crawl-delay, or its host_limits entry) and halves
    # each time it answers 429/503
    host_rate: float = 20.0
    host_rate_max: float = 400.0         # the most requests per second to one host, cluster-wide
    host_limits: dict[str, float] = field(default_factory=dict)   # {"host" or "host:port": requests/s}: fixed ceilings
    host_concurrency: int = 16           # requests in flight to one host
    max_retry_after: float = 60.0        # the longest wait a 429/503 Retry-After is granted
    rate_limit_retries: int = 3          # waits on 429/503 per URL before it is `rate_limited`
    breaker_failures: int = 20           # consecutive failures that stop a task asking a host

    def validate(self, prefix: str) -> None:
        require(16 <= self.image_size <= 4096, join(prefix, "image_size"), f"must be 16..4096, got {self.image_size}")
        require(self.timeout > 0, join(prefix, "timeout"), f"must be > 0 seconds, got {self.timeout}")
        require(self.retries >= 0, join(prefix, "retries"), f"must be >= 0, got {self.retries}")
        require(1 <= self.thread_count <= 1024, join(prefix, "thread_count"), f"must be 1..1024, got {self.thread_count}")
        require(self.samples_per_shard >= 1, join(prefix, "samples_per_shard"), "must be >= 1")
        require(self.compact_rows >= self.samples_per_shard, join(prefix, "compact_rows"),
                f"must be >= samples_per_shard ({self.samples_per_shard}): a partition holds whole shards")
        require(self.host_rate > 0, join(prefix, "host_rate"), f"must be > 0 requests per second, got {self.host_rate}")
        require(self.host_rate_max >= self.host_rate, join(prefix, "host_rate_max"),
                f"must be >= host_rate ({self.host_rate}); set both alike for a fixed rate, got {self.host_rate_max}")
        for who, limit in self.host_limits.items():
            require(isinstance(who, str) and bool(HOST_PORT.fullmatch(who)), join(prefix, "host_limits"),
                    f"{who!r} is not host[:port]" + (f"; write {_host_port(who)!r}" if _host_port(who) else ""))
            require(isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0,
                    join(prefix, "host_limits"), f"{who}: must be > 0 requests per second, got {limit!r}")
        require(self.host_concurrency >= 1, join(prefix, "host_concurrency"), "must be >= 1")
        require(self.urls_per_worker >= 1, join(prefix, "urls_per_worker"),
                f"must be >= 1 (1: a task per CPU whatever the list's size), got {self.urls_per_worker}")
        require(self.max_retry_after >= 0, join(prefix, "max_retry_after"), "must be >= 0 seconds")
        require(self.rate_limit_retries >= 0, join(prefix, "rate_limit_retries"), "must be >= 0")
        require(self.breaker_failures >= 1, join(prefix, "breaker_failures"), "must be >= 1")
        require(0 <= self.task_retries <= 20, join(prefix, "task_retries"),
                f"must be 0..20 (Ray takes -1 as retrying forever), got {self.task_retries}")
        require(self.deadline > 0, join(prefix, "deadline"), f"must be > 0 seconds, got {self.deadline}")
        require(self.pixels_in_flight > 0, join(prefix, "pixels_in_flight"), "must be > 0")
        require(bool(re.fullmatch(r"[A-Za-z0-9_-]+", self.user_agent_token)), join(prefix, "user_agent_token"),
                f"a robots.txt token is letters, digits, '-' and '_', got {self.user_agent_token!r}")
        for entry in self.allow_hosts:
            require(isinstance(entry, str) and bool(HOST_PORT.fullmatch(entry)), join(prefix, "allow_hosts"),
                    f"{entry!r} is not host[:port]" + (f"; write {_host_port(entry)!r}" if _host_port(entry) else
                                                        " (e.g. '10.0.0.5:9000')"))
        require(bool(re.fullmatch(r"[^\x00-\x1f\x7f();]*", self.contact)) and len(self.contact) <= 200,
                join(prefix, "contact"), "a URL or mail address on one line, without ( ) or ; (it goes in the User-Agent)")
        require(0 < self.encode_quality <= 100, join(prefix, "encode_quality"), "must be 1..100")
        require(self.max_bytes > 0, join(prefix, "max_bytes"), "must be > 0")
        # PIL refuses more than twice its MAX_IMAGE_PIXELS (89.5M) whatever we allow, and capline
        # never raises that process-wide limit
        require(0 < self.max_pixels <= 178_956_970, join(prefix, "max_pixels"),
                f"must be > 0 and <= 178956970 (PIL's hard limit), got {self.max_pixels}")
        require(self.min_image_size is None, join(prefix, "min_image_size"),
                "moved: the basic stage drops small images; set stages.basic.min_image_side instead")
        require(self.max_aspect_ratio is None, join(prefix, "max_aspect_ratio"),
                "moved: the basic stage drops by aspect ratio; set stages.basic.max_aspect_ratio instead")
        require(self.deadline >= self.timeout, join(prefix, "deadline"),
                f"must be >= timeout ({self.timeout}s): it bounds the whole URL, got {self.deadline}")
        bad = [f for f in self.formats if f not in FORMATS]
        require(bool(self.formats) and not bad, join(prefix, "formats"),
                f"choose from {', '.join(FORMATS)}" + (f"; not {', '.join(bad)}" if bad else ""))
        require(self.pixels_in_flight >= self.max_pixels, join(prefix, "pixels_in_flight"),
                f"must be >= max_pixels ({self.max_pixels}), or the largest allowed image never decodes")


HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")   # what allow_hosts matches


def _host_port(entry) -> str | None:
    """The host[:port] a URL-shaped allow_hosts entry meant ('http://127.0.0.1:8600/' -> '127.0.0.1:8600')."""
    from urllib.parse import urlsplit

    if not isinstance(entry, str) or "://" not in entry:
        return None
    netloc = urlsplit(entry).netloc.rsplit("@", 1)[-1]
    return netloc if HOST_PORT.fullmatch(netloc) else None


PARTS = "ingest/parts"   # <unit>/{tars,ledger,results,compact}/ per source partition; _summary.parquet


@dataclass(frozen=True)
class ShardJob:
    """One ingest shard: rows [start, stop) of a source partition's kept samples."""
    unit: str          # parts/<unit>/: the source partition's download folder
    shard: int
    source_part: str
    source_file: str
    start: int
    stop: int


def _pacer(ctx):
    """The run's polite.Pacer (a zero-CPU actor on the driver's node), or None outside a Ray cluster."""
    from .polite import Pacer

    return remote.start_here(Pacer, max_concurrency=10_000)


def _release(pacer) -> None:
    remote.stop(pacer)


def _shard_task(storage, job: ShardJob, downloader, base: str, server, shared=None, pacer=None,
                progress=None) -> PartResult:
    """Ray task: download one shard in a local temporary folder, move it into the run folder, index it.

    `server`: (host, pid, start time) of the process serving a served source over loopback (the
    driver). If it died while this shard downloaded, the failures recorded are its death, not the
    URLs': the shard is discarded, and a resumed run downloads it again. `shared`: (the run's registry
    of URLs other shards name too, seconds to wait for another shard's fetch of one) or None
    (stages/ingest/shared_urls.py). `progress`: the run's URL counter (Executor.run's items), told of each
    URL as it finishes. `pacer`: the run's polite.Pacer, which waits that would hold the CPU idle block on.
    """
    import copy
    import tempfile

    from . import fetch   # installs the safe fetcher in this worker

    fetch._finished.report_to(progress)
    fetch.wait_on(pacer)
    downloader = _built(downloader)

    rows = read_kept(storage, job.source_file).slice(job.start, job.stop - job.start)
    keys = rows.column("key").to_pylist()
    todo = rows   # every URL is fetched: caption and image-size drops are the basic stage's
    name = f"{job.shard:05d}"
    unit = f"{PARTS}/{job.unit}"
    verdicts: dict[str, list] = {c: [] for c in ("key", "verdict", "reason", "detail", "tar", "member", "offset",
                                                 "size", "sha256", "width", "height", "url")}

    def add(key, verdict, reason="", detail="", url=None, tar=None, member=None, offset=None, size=None,
            sha=None, w=None, h=None):
        for col, v in zip(verdicts, (key, verdict, reason, detail, tar, member, offset, size, sha, w, h, url)):
            verdicts[col].append(v)

    with tempfile.TemporaryDirectory(prefix="capline-ingest-") as tmp:
        tmp = Path(tmp)
        feather = tmp / f"{name}.feather"
        with pa.ipc.new_file(str(feather), pa.schema([("uid", pa.string()), ("caption", pa.string()),
                                                       ("url", pa.string())])) as w:
            w.write_table(pa.table({
                "uid": todo.column("key"), "caption": todo.column("caption"),
                "url": pa.array([u.replace(SERVER_PLACEHOLDER, base) for u in todo.column("url").to_pylist()],
                                pa.string())}).take(by_host(todo.column("url").to_pylist())))
        out = tmp / "out"
        out.mkdir()
        d = copy.copy(downloader)
        d.output_folder = str(out)
        if todo.num_rows:
            # a URL the shard names more than once is asked of its host once, every row given that
            # download (dedup then drops the copies as exact duplicates, as before)
            from collections import Counter

            named = Counter(u for u in todo.column("url").to_pylist() if u)
            registry, wait_s = shared or (None, 0.0)
            # ... and a URL other shards name too, once for the whole run (stages/ingest/shared_urls.py)
            try:
                across = remote.ask(registry, "which", list(named)) if registry is not None else []
            except remote.Gone:   # the registry is gone: this shard fetches its own URLs
                across = []
            fetch.repeats.expect({u.replace(SERVER_PLACEHOLDER, base) for u, n in named.items() if n > 1},
                                 shared={u.replace(SERVER_PLACEHOLDER, base) for u in across},
                                 registry=registry, wait_s=wait_s)
            try:
                d.download_shard((job.shard, str(feather)))
            finally:
                fetch.repeats.clear()
            if server is not None and not _alive(*server):
                raise RuntimeError(f"shard {name}: the loopback server (pid {server[1]}) went away mid-download")
            tar_local, meta = out / f"{name}.tar", pq.read_table(out / f"{name}.parquet")
            members = _tar_index(tar_local)
            for suffix in (".tar", ".parquet", "_stats.json"):   # stats last: the shard is whole
                storage.write_bytes(f"{unit}/shards/{name}{suffix}", (out / f"{name}{suffix}").read_bytes())
            tar_rel = f"{unit}/shards/{name}.tar"
            for r in meta.select(["uid", "key", "url", "status", "error_message", "sha256", "original_width",
                                  "original_height"]).to_pylist():
                if r["status"] == "success":
                    member = f"{r['key']}.{downloader.encode_format}"
                    off, size = members.get(member, (None, None))
                    if off is None:
                        add(r["uid"], DROPPED, "download_error", "img2dataset recorded it but wrote no image",
                            url=r["url"])
                        continue
                    add(r["uid"], KEPT, "", f"shard {name}, member {member}", r["url"], tar_rel, member, off,
                        size, r["sha256"], r["original_width"], r["original_height"])
                else:
                    from .fetch import failure_of

                    failure = failure_of(r["status"], r["error_message"])
                    add(r["uid"], DROPPED, failure.reason, failure.detail, url=r["url"])
    table = pa.table({c: pa.array(v, SAMPLE_SCHEMA.field(c).type) for c, v in verdicts.items()})
    # the shard's failures by host, for the ingest report, stay beside it: its result (what the
    # driver holds for every shard) carries counts only
    paced = fetch.pacing() if todo.num_rows else {"thread_s": 0.0, "idle_s": 0.0, "yielded_s": 0.0, "rates": {}}
    storage.write_json(f"{unit}/failures/{name}.json", {"throttled": _throttled(), "paced": paced["rates"],
                                                         **failures_by_host(verdicts)})
    result = write_part(storage, "ingest", f"{job.unit}-{name}", job.source_part, keys,
                        _with_state(table, rows), rel=f"{unit}/ledger/{name}.parquet", notes=IngestStage.notes,
                        extra={"node": remote.node_id(),
                               "successes": sum(v == KEPT for v in verdicts["verdict"]),
                               "paced_thread_s": paced["thread_s"], "paced_idle_s": paced["idle_s"],
                               "paced_yielded_s": paced["yielded_s"]})
    storage.write_bytes(f"{unit}/results/{name}.json", json.dumps(result.to_json(), sort_keys=True).encode())
    fetch._finished.flush()
    return result


TOP_FAILURES = 50   # (host, reason) counts a shard reports: bounded, whatever the number of hosts


def by_host(urls: list) -> list[int]:
    """The order a shard asks its URLs in: each host's URLs spread evenly over the shard (its j-th of n
    at (j + 0.5) / n), so the threads hold URLs of many hosts at once and seldom all wait on one."""
    from urllib.parse import urlsplit

    hosts: dict[str, list[int]] = {}
    for i, u in enumerate(urls):
        try:
            netloc = urlsplit(u or "").netloc
        except ValueError:
            netloc = ""
        hosts.setdefault(netloc, []).append(i)
    spread = [((j + 0.5) / len(rows), h, i) for h, rows in enumerate(hosts.values()) for j, i in enumerate(rows)]
    return [i for _, _, i in sorted(spread)]


def _throttled() -> dict:
    from .fetch import throttled

    return dict(sorted(throttled().items(), key=lambda kv: -kv[1][1])[:TOP_FAILURES])


def failures_by_host(verdicts: dict[str, list]) -> dict:
    """A shard's failed downloads counted by (host, reason), the most frequent TOP_FAILURES of them
    (the rest summed as `other`), and up to 2 examples per reason: for the ingest report."""
    from collections import Counter
    from urllib.parse import urlsplit

    counts: Counter = Counter()
    examples: dict[str, list] = {}
    for key, verdict, reason, detail, url in zip(*(verdicts[c] for c in ("key", "verdict", "reason", "detail", "url"))):
        if verdict == KEPT:
            continue
        try:
            host = urlsplit(url or "").netloc or "(no host)"
        except ValueError:
            host = "(unparseable URL)"
        counts[f"{host}\t{reason}"] += 1
        if len(examples.setdefault(reason, [])) < 2:
            examples[reason].append({"key": key, "url": url, "detail": detail})
    top = dict(counts.most_common(TOP_FAILURES))
    return {"failures": top, "failures_other": sum(counts.values()) - sum(top.values()), "failure_examples": examples}


REPORT_PAIRS, REPORT_HOSTS = 2000, 100     # (host, reason) counts and slowed hosts a merged table keeps


def merge_failures(tables) -> dict:
    """Shards' (or units') failure tables -> one, bounded: the REPORT_PAIRS most frequent (host,
    reason) counts (the rest summed as `failures_other`), 3 examples per reason, the REPORT_HOSTS
    hosts that made capline wait longest."""
    from collections import Counter

    by_pair: Counter = Counter()
    other = 0
    examples: dict[str, list] = {}
    slowed: dict[str, list] = {}
    paced: dict[str, float] = {}
    for t in tables:
        for host, rate in t.get("paced", {}).items():     # the slowest pace any shard ended at
            paced[host] = min(rate, paced.get(host, rate))
        by_pair.update(t.get("failures", {}))
        other += t.get("failures_other", 0)
        for reason, rows in t.get("failure_examples", {}).items():
            examples.setdefault(reason, []).extend(rows[: 3 - len(examples.get(reason, []))])
        for host, (times, waited) in t.get("throttled", {}).items():
            got = slowed.setdefault(host, [0, 0.0])
            got[0] += times
            got[1] += waited
    top = dict(by_pair.most_common(REPORT_PAIRS))
    return {"failures": top, "failures_other": other + sum(by_pair.values()) - sum(top.values()),
            "failure_examples": examples,
            "throttled": dict(sorted(slowed.items(), key=lambda kv: -kv[1][1])[:REPORT_HOSTS]),
            "paced": dict(sorted(paced.items(), key=lambda kv: kv[1])[:REPORT_HOSTS])}


def _failure_tables(storage, units: dict[str, list[str]]) -> dict:
    """Ray task: the ingest report's table over every shard of every unit (source partition), read
    beside the shards, never through the driver. A unit's merged table is kept beside it
    (`failures.json`, with the shards it covers): a later run reads one file per unchanged unit and
    the shards of the others only. A shard recorded by an older version carries its table in its
    result instead."""
    cached = storage.read_jsons([f"{PARTS}/{unit}/failures.json" for unit in units])
    merged = []
    for (unit, names), have in zip(units.items(), cached):
        if isinstance(have, dict) and have.get("shards") == names:
            merged.append(have)
            continue
        tables = storage.read_jsons([f"{PARTS}/{unit}/failures/{n}.json" for n in names])
        missing = [n for n, t in zip(names, tables) if t is None]
        if missing:       # an older version's shards: the table is in the result's extra
            olds = dict(zip(missing, storage.read_jsons([f"{PARTS}/{unit}/results/{n}.json" for n in missing])))
            tables = [t if t is not None else (olds[n] or {}).get("extra", {}) for n, t in zip(names, tables)]
        table = {**merge_failures(tables), "shards": names}
        storage.write_json(f"{PARTS}/{unit}/failures.json", table)
        merged.append(table)
    return merge_failures(merged)


def write_report(stage_dir: Path, table: dict, name: str) -> Path:
    """`ingest/report.html`: failed downloads by host and reason, with examples (`merge_failures`)."""
    import html
    from collections import Counter

    by_pair: Counter = Counter(table.get("failures", {}))
    other = table.get("failures_other", 0)
    examples: dict[str, list] = table.get("failure_examples", {})
    slowed: dict[str, list] = table.get("throttled", {})
    paced: dict[str, float] = table.get("paced", {})
    by_host: Counter = Counter()
    reasons: Counter = Counter()
    for pair, n in by_pair.items():
        host, reason = pair.split("\t", 1)
        by_host[host] += n
        reasons[reason] += n
    cols = [r for r, _ in reasons.most_common()]
    rows = []
    for host, total in by_host.most_common(40):
        cells = "".join(f"<td>{by_pair.get(host + chr(9) + r, '') or ''}</td>" for r in cols)
        rows.append(f"<tr><td>{html.escape(host)}</td><td>{total}</td>{cells}</tr>")
    ex = "".join(f"<h3>{html.escape(r)}</h3><ul>" + "".join(
        f"<li><code>{html.escape(e['key'])}</code> {html.escape(e['url'] or '')}: {html.escape(e['detail'] or '')}</li>"
        for e in examples.get(r, [])) + "</ul>" for r in cols)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>Ingest: {html.escape(name)}</title>"
            "<style>body{font:14px sans-serif;margin:1.5em}td,th{border:1px solid #ccc;padding:3px 8px}"
            "table{border-collapse:collapse}</style></head><body>"
            f"<h1>Ingest failures: {html.escape(name)}</h1><p>{sum(by_pair.values()) + other} failed downloads"
            + (f" ({other} in (host, reason) pairs too rare to list)" if other else "") + ".</p>"
            "<h2>By host and reason</h2><table><tr><th>host</th><th>failed</th>"
            + "".join(f"<th>{html.escape(r)}</th>" for r in cols) + "</tr>" + "".join(rows) + "</table>"
            "<h2>Examples</h2>" + ex
            + "<h2>Hosts that asked to slow down (429/503), waited for as asked</h2>"
            + ("<table><tr><th>host</th><th>times</th><th>seconds waited</th></tr>" + "".join(
                f"<tr><td>{html.escape(h)}</td><td>{t}</td><td>{w:.1f}</td></tr>"
                for h, (t, w) in sorted(slowed.items(), key=lambda kv: -kv[1][1])) + "</table>" if slowed else "<p>none</p>")
            + "<h2>Hosts that pushed back or answered slowly, and the pace capline ended at</h2>"
            + ("<table><tr><th>host</th><th>slowest pace a shard ended at, requests/s for the cluster</th></tr>" + "".join(
                f"<tr><td>{html.escape(h)}</td><td>{r:.2f}</td></tr>" for h, r in sorted(paced.items(), key=lambda kv: kv[1]))
               + "</table>" if paced else "<p>none: no host asked capline to slow down, and none answered slowly</p>")
            + "<p>Refused by robots.txt or X-Robots-Tag: the <code>robots_disallowed</code> column; given up after "
              "waits: <code>rate_limited</code>; hosts that failed too often in a row: <code>host_unavailable</code>.</p>"
            + "</body></html>")
    path = stage_dir / "report.html"
    stage_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path


def _with_state(verdicts: pa.Table, rows: pa.Table) -> pa.Table:
    """Carry the source's caption and partition; the URL is the one fetched (a served source's list
    names its server as a placeholder), the list's own where nothing was fetched."""
    state = rows.select(["key", "caption", "partition", "url", "notes"] if "notes" in rows.column_names
                        else ["key", "caption", "partition", "url"]).rename_columns(
        ["key", "caption", "partition", "src_url", *(["notes"] if "notes" in rows.column_names else [])])
    t = verdicts.join(state, "key", join_type="left outer")
    url = pc.if_else(pc.is_null(t.column("url")), t.column("src_url"), t.column("url"))
    return t.set_column(t.column_names.index("url"), "url", url).drop_columns(["src_url"])


def _tar_index(path: Path) -> dict[str, tuple[int, int]]:
    """member name -> (offset of its data, size): what a reader needs to fetch one image by range."""
    import tarfile

    with tarfile.open(path) as tar:
        return {m.name: (m.offset_data, m.size) for m in tar if m.isfile()}


def _alive(host: str, pid: int, started: float) -> bool:
    import socket

    import psutil

    if host != socket.gethostname():
        return True   # cannot tell from here (and a loopback server is reachable only on its host)
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False


class IngestStage(Source):
    """Downloads the source's URLs: samples with images out, every failure a verdict."""
    name = "ingest"
    config_key, config_class = "ingest", IngestConfig
    report = "ingest/report.html"
    notes = (None, None)          # a download's details stay in the ledger, not in the sample's json
    thresholds = True             # its size and format bounds are a filter's thresholds
    preserve = ("parts",)
    dead_end_share = 0.9
    remedies = {
        "unsafe_url:private_address": "the URLs point at private or loopback addresses, refused unless trusted: "
                                      "list those hosts in stages.ingest.allow_hosts (e.g. ['10.0.0.5:9000'])",
        "unsafe_url:metadata_address": "the URLs point at a cloud metadata address, which is never fetched",
        "dns_error": "the hosts' names do not resolve from the workers: check their DNS",
        "timeout": "the servers did not answer in time: raise stages.ingest.timeout",
        "deadline_exceeded": "downloads ran past the deadline: raise stages.ingest.deadline",
        "too_many_bytes": "the responses are larger than stages.ingest.max_bytes: raise it",
        "image_too_large": "the images are larger than stages.ingest.max_pixels: raise it",
        "unsupported_format": "the images are in formats outside stages.ingest.formats",
    }

    def run(self, ctx: StageContext) -> StageResult:
        from contextlib import nullcontext

        from ..source.demo_server import DemoServer

        cfg: IngestConfig = ctx.cfg
        site = ctx.artifact("source", "site")
        served = site["served"]   # files the source stage made: served over loopback here
        fp = hashlib.sha256(ctx.fingerprint.encode()).hexdigest()
        jobs, wanted, units = [], {}, set()
        for u in ctx.upstream or []:
            unit = f"{safe_name(u.part)}-{hashlib.sha256((fp + u.sha256).encode()).hexdigest()[:12]}"
            units.add(unit)
            for i, start in enumerate(range(0, u.kept, cfg.samples_per_shard)):
                job = ShardJob(unit, i, u.part, u.file, start, min(u.kept, start + cfg.samples_per_shard))
                wanted[job] = f"{PARTS}/{unit}/results/{i:05d}.json"
        # every shard and group record of earlier runs in one read (records.py); a unit's folder is
        # listed only where a shard is missing from it (new, or finished after the last summary)
        summary = {PARTS: records.read_summary(ctx.storage, PARTS)}
        found = records.find(ctx.storage, wanted, summaries=summary)
        reused = [PartResult.from_json(found[j]) for j in wanted if j in found]
        jobs = [j for j in wanted if j not in found]
        gone = sorted(set(ctx.storage.list_dirs(PARTS)) - units)
        ctx.storage.delete_all([f"{PARTS}/{stale}" for stale in gone])   # partitions no longer in the source
        if reused:
            ctx.log(f"ingest: {len(reused)} shards downloaded before, reused; {len(jobs)} to download")
        results, across = [], {"urls": 0, "fetched": 0, "served": 0}
        if jobs:
            server = (DemoServer(ctx.run_dir / site["folder"], site["slow_seconds"], site["port"], log=ctx.log)
                      if served else nullcontext())
            with server:
                allow = tuple(cfg.allow_hosts) + ((server.netloc,) if served else ())
                base = server.base_url if served else ""
                alive = None
                if served:   # the loopback server is this process
                    import socket

                    import psutil

                    alive = (socket.gethostname(), os.getpid(), psutil.Process().create_time())
                # the cluster-wide per-host manners, shared out among the tasks that may run at once: the
                # executor's window, since a task waiting on a host gives its CPU to a queued one
                sizes = [j.stop - j.start for j in jobs]
                at_once = max(1, min(len(jobs), ctx.executor.tasks_at_once(1, sizes, cfg.urls_per_worker)))
                pacer = None if served else _pacer(ctx)     # capline's own loopback site is not paced
                # built in the workers (img2dataset's import is seconds the driver need not spend)
                downloader = (cfg, allow, at_once, (server.netloc,) if served else ())
                registry = shared_urls.find(ctx, jobs)
                # a claimant's fetch of a shared URL is waited for this long before asking the host again
                shared = (registry, 2 * cfg.deadline + 10) if registry is not None else None
                start = time.time()
                try:
                    results = ctx.run(_shard_task, [(ctx.storage, j, downloader, base, alive, shared, pacer) for j in jobs],
                                      "ingest",
                                      num_cpus=1, max_retries=cfg.task_retries,
                                      describe=lambda c: f"shard {c[1].unit}/{c[1].shard:05d}", unit="shards",
                                      items=sizes, items_per_worker=cfg.urls_per_worker)   # progress in URLs, not shards
                finally:
                    across = shared_urls.close(registry)
                    _release(pacer)
                elapsed = time.time() - start
                if across["urls"]:
                    ctx.log(f"ingest: {across['urls']} URLs named by several shards, fetched {across['fetched']} "
                            f"times; {across['served']} times a shard took another shard's download instead of asking")
        shards = reused + results
        by_unit: dict[str, list[str]] = {}
        for job in wanted:
            by_unit.setdefault(job.unit, []).append(f"{job.shard:05d}")
        table = ctx.call(_failure_tables, ctx.storage, by_unit, what="ingest report", num_cpus=0.25)
        report = write_report(ctx.stage_dir, table, ctx.run_name)
        ctx.log(f"ingest: failures by host and reason in {report}")
        used = {rel: r.to_json() for rel, r in zip([wanted[j] for j in wanted if j in found] + [wanted[j] for j in jobs],
                                                   shards)}
        parts = compact(ctx, shards, shards_per_partition(cfg), summary[PARTS], used)
        records.write_summary(ctx.storage, PARTS, used)
        ok = sum(p.extra["successes"] for p in results)
        nodes = sorted({p.extra["node"] for p in results if p.extra.get("node")})
        idle = sum(p.extra.get("paced_idle_s", 0.0) for p in results)
        if idle >= 1:
            ctx.log(f"ingest: download tasks held their CPU {idle:.0f}s with every thread waiting on a host's pace "
                    f"({sum(p.extra.get('paced_thread_s', 0.0) for p in results):.0f} thread-seconds of waiting in all)")
        return StageResult(parts, {"shards": len(shards), "partitions": len(units), "compacted_to": len(parts), "nodes": nodes,
                                   "images_per_second": (ok / elapsed) if results and elapsed > 0 else None,
                                   "paced_idle_seconds": round(idle, 1),
                                   "paced_yielded_seconds": round(sum(p.extra.get("paced_yielded_s", 0.0) for p in results), 1),
                                   "paced_thread_seconds": round(sum(p.extra.get("paced_thread_s", 0.0) for p in results), 1),
                                   "urls_in_several_shards": across["urls"], "downloads_shared_across_shards": across["served"]},
                           artifacts={"ledger": "ingest/parts.json", "report": "ingest/report.html"})


def shards_per_partition(cfg: IngestConfig) -> int:
    """Shards joined into one partition for the stages after ingest: `compact_rows` samples' worth,
    from the config alone. Never from the cluster's size or the data's: a partition is then the same
    consecutive shards of one source partition on any cluster and after any append, and every stage
    after ingest reuses it."""
    return max(1, cfg.compact_rows // cfg.samples_per_shard)


def compact(ctx: StageContext, shards: list[PartResult], per: int, before: dict[str, dict],
            used: dict[str, dict]) -> list[PartResult]:
    """The shards' ledgers joined, `per` consecutive shards of one source partition at a time (their
    tars stay where they are: rows point at them). A group joined before from the same shards is
    reused (its record in `before`, ingest's summary of the last run, or written since); a lone
    shard is its own partition. The records used are added to `used`."""
    units: dict[str, list[PartResult]] = {}
    for p in shards:
        units.setdefault(p.file.split("/")[2], []).append(p)   # ingest/parts/<unit>/ledger/<shard>.parquet
    out, joined = [], []
    for unit, members in sorted(units.items()):
        members.sort(key=lambda p: p.file)
        for i in range(0, len(members), per):
            group = members[i:i + per]
            if len(group) == 1:
                out.append(group[0])
                continue
            first, last = (Path(g.file).stem for g in (group[0], group[-1]))
            joined.append((unit, first, last, group))
    rels = [f"{PARTS}/{unit}/compact/{first}-{last}" for unit, first, last, _ in joined]
    done = records.find(ctx.storage, {r: f"{r}.json" for r in rels}, summaries={PARTS: before})
    calls = []
    for rel, (unit, first, last, group) in zip(rels, joined):
        shas = [g.sha256 for g in group]
        if rel in done and done[rel].get("members") == shas:
            out.append(PartResult.from_json(done[rel]["result"]))
            used[f"{rel}.json"] = done[rel]
        else:
            calls.append((ctx.storage, [g.file for g in group], shas, f"{unit}-{first}-{last}", rel, group[0].input))
    # groupings of an earlier run (another compact_rows) in a unit still used: known from the summary
    stale = [r for r in before if "/compact/" in r and r not in used and r.split("/")[2] in units]
    ctx.storage.delete_files([f for r in stale for f in (r, r[:-len(".json")] + ".parquet")])
    if calls:
        made = ctx.run(_compact_task, calls, "ingest compact", num_cpus=0.5, unit="partitions")
        used.update({f"{c[4]}.json": {"members": c[2], "result": r.to_json()} for c, r in zip(calls, made)})
        out += made
        ctx.log(f"ingest: {len(shards)} shards joined into {len(out)} partitions for the stages after it")
    return sorted(out, key=lambda p: p.part)


def _compact_task(storage, files: list[str], shas: list[str], name: str, rel: str, source_part: str) -> PartResult:
    """Ray task: a group of shards' ledgers as one partition (rows only; the images stay in their tars)."""
    table = pa.concat_tables(storage.read_tables(files))
    result = write_part(storage, "ingest", name, source_part, table.column("key").to_pylist(), table,
                        rel=f"{rel}.parquet", notes=IngestStage.notes)
    storage.write_json(f"{rel}.json", {"members": shas, "result": result.to_json()})
    return result


HEADER_DIRECTIVES = ("noai", "noimageai", "noindex", "noimageindex")    # X-Robots-Tag values that opt out


def fetch_policy(cfg: IngestConfig, allow: tuple, at_once: int = 1, own: tuple = ()):
    """What every fetch of the run obeys: the safe fetcher's limits and the per-host manners, each
    host's rate and concurrency shared out among `at_once` tasks that may ask it at once."""
    from .fetch import FetchPolicy
    from .polite import Manners

    manners = Manners(token=cfg.user_agent_token, rate=cfg.host_rate / at_once, max_rate=cfg.host_rate_max / at_once,
                      share=at_once, limits=tuple(sorted((h, float(r)) for h, r in cfg.host_limits.items())),
                      concurrency=max(1, cfg.host_concurrency // at_once), robots=cfg.respect_robots,
                      max_wait=cfg.max_retry_after, retries=cfg.rate_limit_retries,
                      breaker_failures=cfg.breaker_failures, contact=cfg.contact, wait_budget=cfg.host_wait_budget)
    return FetchPolicy(allow_hosts=allow, max_bytes=cfg.max_bytes, max_pixels=cfg.max_pixels,
                       deadline=cfg.deadline, formats=tuple(cfg.formats),
                       pixels_in_flight=cfg.pixels_in_flight, manners=manners, own_hosts=own,
                       resize=(cfg.resize_mode, cfg.image_size))


_BUILT: dict[str, object] = {}


def _built(spec):
    """The downloader of `spec` (_downloader's arguments), built once per worker process."""
    import pickle

    if not isinstance(spec, tuple):
        return spec
    key = hashlib.sha256(pickle.dumps(spec)).hexdigest()
    if key not in _BUILT:
        _BUILT.clear()
        cfg, allow, at_once, own = spec
        _BUILT[key] = _downloader(cfg, allow, at_once, own=own)
    return _BUILT[key]


def _downloader(cfg: IngestConfig, allow: tuple, at_once: int = 1, own: tuple = ()):
    from .fetch import SafeDownloader
    from .img2dataset_parts import TarSampleWriter
    from .resize import resizer_class

    resizer = resizer_class()(image_size=cfg.image_size, resize_mode=cfg.resize_mode,
                      resize_only_if_bigger=False, encode_quality=cfg.encode_quality,
                      encode_format=cfg.encode_format, min_image_size=0, max_aspect_ratio=float("inf"))
    return SafeDownloader(
        sample_writer_class=TarSampleWriter, resizer=resizer, thread_count=cfg.thread_count,
        save_caption=True, extract_exif=False, output_folder="/nonexistent",
        column_list=["uid", "caption", "url"], timeout=cfg.timeout,
        number_sample_per_shard=cfg.samples_per_shard, oom_shard_count=5, compute_hash="sha256",
        verify_hash_type=None, encode_format=cfg.encode_format, retries=cfg.retries,
        user_agent_token=cfg.user_agent_token,
        disallowed_header_directives=list(HEADER_DIRECTIVES), policy=fetch_policy(cfg, allow, at_once, own))
