"""URLs that more than one ingest shard of a run names, each downloaded once for the whole run.

A shard already asks a host once for a URL it names several times (stages/ingest/fetch.py `repeats`). A
list that names a URL in several shards (a placeholder, a logo, a popular picture: alt-text lists
repeat URLs across their whole length) asked once per shard. Before the shards download:

1. A shuffle through Ray's object store (Executor.shuffle): a task per source partition reads the
   URL column of the rows its shards download once and hands each URL-hash bucket its (url, shard)
   pairs; a task per bucket finds the URLs named by two shards or more and tells the run's registry.
2. The registry (a zero-CPU Ray actor, one per run's ingest) holds those URLs. A shard task asks it
   once which of its URLs are shared; the first thread of the cluster to fetch such a URL claims it,
   the others wait for its result (bytes or failure, kept in the object store by the registry) and
   never ask the host. A claimant that goes quiet (its worker died) is waited for a bounded time,
   then the URL is fetched again by whoever waits.

Every row still gets its own verdict and its own member in its shard's tar, as within a shard:
dedup then drops the copies as exact duplicates, the ledgers and shards are those of a run that
downloaded each row. The driver holds the registry's handle and reads its counts once.
"""
from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc

from infra import remote

from ..dataplane import hash_pieces, read_kept

URL_ROWS_PER_BUCKET = 2_000_000      # (url, shard) rows one bucket task takes (~200 bytes each in memory)


def _url_pieces(storage, file: str, ranges: list[tuple[int, int, int]], n: int) -> list[pa.Table]:
    """Ray task (the shuffle's map): the URLs of one source partition's shards being downloaded,
    (url, shard) once each, cut into `n` pieces by the URL's hash. `ranges`: (shard id, start, stop)."""
    urls = read_kept(storage, file, ["url"]).column("url")
    parts = []
    for shard, start, stop in ranges:
        u = pc.unique(urls.slice(start, stop - start))
        u = u.filter(pc.invert(pc.is_null(u)))
        parts.append(pa.table({"url": u, "shard": pa.array([shard] * len(u), pa.int64())}))
    t = pa.concat_tables(parts) if parts else pa.table({"url": pa.array([], pa.string()),
                                                          "shard": pa.array([], pa.int64())})
    return hash_pieces(t, t.column("url").to_pylist(), n)


def _shared_reduce(registry, *pieces: pa.Table) -> int:
    """Ray task (the shuffle's reduce): one bucket's URLs named by two shards or more, told to the
    registry; -> how many."""
    if not pieces:
        return 0
    t = pa.concat_tables(pieces)
    counts = t.group_by("url").aggregate([("shard", "count_distinct")])
    shared = counts.filter(pc.greater(counts.column("shard_count_distinct"), 1)).column("url").to_pylist()
    if shared:
        remote.ask(registry, "add", shared)
    return len(shared)


class UrlRegistry:
    """Ray actor: the run's shared URLs and, once fetched, their result (an object the actor owns)."""

    def __init__(self):
        self.shared: set[str] = set()
        self.state: dict[str, object] = {}     # url -> "busy" (claimed) or the result's ObjectRef
        self.served = 0                        # rows given another thread's download

    def add(self, urls: list[str]) -> None:
        self.shared.update(urls)

    def which(self, urls: list[str]) -> list[str]:
        return [u for u in urls if u in self.shared]

    def claim(self, url: str):
        """-> ("mine", None): fetch it and `finish`; ("busy", None): another is fetching it; ("done", [ref])."""
        got = self.state.get(url)
        if got is None:
            self.state[url] = "busy"
            return "mine", None
        if got == "busy":
            return "busy", None
        self.served += 1
        return "done", [got]        # in a list: Ray hands the reference over, not its value

    def finish(self, url: str, data: bytes | None, err: str | None) -> None:
        self.state[url] = remote.put((data, err))

    def counts(self) -> dict:
        return {"urls": len(self.shared), "fetched": sum(1 for v in self.state.values() if v != "busy"),
                "served": self.served}


def find(ctx, jobs: list) -> object | None:
    """The registry of this run's URLs named by more than one of `jobs` (ingest ShardJobs), or None
    when there are none (or a single shard: a shard handles its own repeats)."""
    if len(jobs) < 2:
        return None
    by_file: dict[str, list] = {}
    for i, j in enumerate(jobs):
        by_file.setdefault(j.source_file, []).append((i, j.start, j.stop))
    rows = sum(j.stop - j.start for j in jobs)
    n = max(1, math.ceil(rows / URL_ROWS_PER_BUCKET))
    # on the driver's node: a worker node lost mid-run does not take it along (and if it goes, the
    # shards fetch their URLs themselves: stages/ingest/fetch.py)
    registry = remote.start_here(UrlRegistry)
    found = ctx.shuffle(_url_pieces, [(ctx.storage, f, r, n) for f, r in by_file.items()], n, _shared_reduce,
                        [(registry,)] * n, "ingest shared URLs", num_cpus=0.5, unit="buckets")
    if not sum(found):
        remote.stop(registry)
        return None
    ctx.log(f"ingest: {sum(found)} URLs are named by more than one shard: each is downloaded once for the run")
    return registry


def close(registry) -> dict:
    """The registry's counts; the actor (and the results it holds) released."""
    if registry is None:
        return {"urls": 0, "fetched": 0, "served": 0}
    try:
        return remote.ask(registry, "counts", timeout=60)
    except Exception:  # noqa: BLE001 - a registry lost with its node: the counts are gone, the downloads are not
        return {"urls": 0, "fetched": 0, "served": 0}
    finally:
        remote.stop(registry)
