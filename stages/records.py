"""Per-partition task records, found by key through one summary table: how a stage reuses the work
of an earlier run without the driver reading one object per partition.

A task that finishes a partition writes its record (`<folder>/<key>.json`, small: counts,
checksums, digests) last, after its outputs: a record found means whole outputs, so a run killed
mid-stage resumes from what its tasks finished. Once the stage has its results, the driver writes
them all as one table (`<folder>/_summary.parquet`: each record's path, and the record as JSON). The next run reads that
table in one request. Keys the summary lacks (new partitions, or tasks that finished after the last
summary) are read directly, 32 at a time, when they are few beside the summary (a 1 % append:
requests grow with what changed, not with the line); many of them, or no summary at all, and the
folder is listed (1,000 keys a request) to read only those there. Nothing on the driver reads
partitions' records one by one.
"""
from __future__ import annotations

import json
import posixpath

import pyarrow as pa

SUMMARY = "_summary.parquet"
DIRECT_READS = 32         # records read at once (Storage.read_jsons)
LIST_PAGE = 1000          # keys an object store lists per request


def summary_path(folder: str) -> str:
    return f"{folder}/{SUMMARY}"


def read_summary(storage, folder: str) -> dict[str, dict]:
    """record path -> record, from the folder's summary table; {} if there is none (or it is torn)."""
    try:
        table = storage.read_table(summary_path(folder))
    except (FileNotFoundError, OSError, pa.ArrowInvalid):
        return {}
    return {k: json.loads(r) for k, r in zip(table.column("path").to_pylist(), table.column("record").to_pylist())}


def write_summary(storage, folder: str, records: dict[str, dict]) -> None:
    """record path -> record: every record this run uses, as one table (one write)."""
    paths = sorted(records)
    storage.write_table(summary_path(folder), pa.table({
        "path": pa.array(paths, pa.string()),
        "record": pa.array([json.dumps(records[k], sort_keys=True) for k in paths], pa.string())}))


def find(storage, wanted: dict[str, str], summaries: dict[str, dict] | None = None) -> dict[str, dict]:
    """wanted: key -> its record's path (`<folder>/<name>.json`). -> key -> record for those that
    exist. `summaries`: folder -> summary already read (`read_summary`), for records kept in a
    summary of another folder than their own (ingest's, one for all its partitions)."""
    by_folder: dict[str, dict[str, str]] = {}
    for key, rel in wanted.items():
        by_folder.setdefault(posixpath.dirname(rel), {})[key] = rel
    found: dict[str, dict] = {}
    known = {rel: r for s in (summaries or {}).values() for rel, r in s.items()}
    lacking: dict[str, dict[str, str]] = {}
    read_summary_cache: dict[str, dict] = {}
    for folder, keys in by_folder.items():
        if summaries is None:
            summary = read_summary_cache[folder] = read_summary(storage, folder)
        else:
            summary = known
        found.update({k: summary[rel] for k, rel in keys.items() if rel in summary})
        missing = {k: rel for k, rel in keys.items() if k not in found}
        if missing:
            lacking[folder] = missing
    # written since the last summary? read directly when few beside what the summary holds (rounds
    # of 32 parallel reads no more than the pages a listing of the folder takes), else listed
    from collections import Counter

    held = Counter(posixpath.dirname(rel) for s in ([known] if summaries is not None else read_summary_cache.values())
                   for rel in s)
    to_read: list[tuple[str, str]] = []
    listed_folders = []
    for folder, keys in lacking.items():
        if held[folder] and len(keys) <= DIRECT_READS * max(1, -(-held[folder] // LIST_PAGE)):
            to_read += list(keys.items())
        else:
            listed_folders.append(folder)
    for folder, listed in zip(listed_folders, _listings(storage, listed_folders)):
        to_read += [(k, rel) for k, rel in lacking[folder].items() if rel in listed]
    for (k, _), record in zip(to_read, storage.read_jsons([rel for _, rel in to_read])):
        if record is not None:
            found[k] = record
    return found


def _listings(storage, folders: list[str]) -> list[set[str]]:
    from concurrent.futures import ThreadPoolExecutor

    if len(folders) < 2:
        return [set(storage.list(f, ".json")) for f in folders]
    with ThreadPoolExecutor(min(16, len(folders))) as pool:
        return list(pool.map(lambda f: set(storage.list(f, ".json")), folders))


def stale_files(storage, folder: str, used: set[str], previous: dict | None = None, keep=None) -> list[str]:
    """Files in `folder` (recursively) that are neither in `used` (nor kept by `keep(path)`) nor its
    summary: outputs of partitions no current input maps to. One listing; none when `previous` (the
    folder's summary before this run) names only records still used: then every file there is one
    of theirs or of a partition this run added (a dataset line's append lists nothing)."""
    if previous and all(rel in used for rel in previous):
        return []
    return [f for f in storage.list(folder, recursive=True)
            if f not in used and f != summary_path(folder) and not (keep and keep(f))]
