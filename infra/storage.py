"""Storage, written once: the run folder's filesystem and paths that may be object-storage URIs.

`Storage` is a pyarrow.fs filesystem and a root, so a local folder and an s3:// bucket are the same
code; picklable into any Ray task. Stages, the executor and training all read and write through it.
It is the one module that tells a local folder from a bucket (`is_local`); code elsewhere asks it.

URIs (`s3://bucket/key`, `gs://...`) go through pyarrow.fs. Credentials and endpoint come from the
usual environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_DEFAULT_REGION,
AWS_ENDPOINT_URL for S3-compatible stores); capline never takes them as arguments, so they never
reach a config, a manifest or a log.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pathlib import Path

from .errors import UserError


_blocked: str | None = None


def block_writes(reason: str | None) -> None:
    """Refuse (reason) or allow again (None) every write through a Storage in this process: a run that
    lost its lock stops writing at once, whatever the main thread is doing."""
    global _blocked
    _blocked = reason


@dataclass
class Storage:
    """The run folder's filesystem, picklable into any task: local, or s3:// through pyarrow.fs."""
    fs: Any
    root: str

    @classmethod
    def local(cls, path) -> "Storage":
        import pyarrow.fs as pafs
        from pathlib import Path

        return cls(pafs.LocalFileSystem(), str(Path(path).resolve()))

    @classmethod
    def of(cls, where) -> "Storage":
        """A Storage as it is, or a local folder's."""
        return where if isinstance(where, Storage) else cls.local(where)

    @classmethod
    def from_uri(cls, uri: str) -> "Storage":
        fs, root = filesystem(uri)
        return cls(fs, root.rstrip("/"))

    @property
    def is_local(self) -> bool:
        return self.fs.type_name == "local"

    @property
    def _objects(self) -> bool:
        """S3: this class's own calls go through infra/objects.py, a request per object. (Ray Data,
        Parquet filter reads and training open `fs`, pyarrow's filesystem, as files.)"""
        return self.fs.type_name == "s3"

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def uri(self, rel: str = "") -> str:
        """What a user or another tool opens: a local path, or `s3://bucket/key`."""
        return self.path(rel) if self.is_local else f"{self.fs.type_name}://{self.path(rel)}"

    def _ensure_parent(self, rel: str) -> None:
        """A local folder for the file; an object store has no folders to make (pyarrow would PUT a
        marker per level, on every write)."""
        if self.is_local:
            self.fs.create_dir(self.path(rel).rsplit("/", 1)[0], recursive=True)

    def write_bytes(self, rel: str, data: bytes) -> str:
        """Write whole or not at all (temp + move where moves exist); -> sha256 of the bytes."""
        return self._write_whole(rel, [data])

    def write_file(self, rel: str, local_path, chunk: int = 64 << 20) -> str:
        """A local file's bytes to `rel`, streamed a piece at a time (never whole in memory), whole
        or not at all as `write_bytes`; -> sha256 of the bytes."""
        def pieces():
            with open(local_path, "rb") as src:
                while piece := src.read(chunk):
                    yield piece

        return self._write_whole(rel, pieces())

    def _write_whole(self, rel: str, pieces) -> str:
        if _blocked:   # this process lost its run folder's lock: nothing more is written
            raise UserError(_blocked)
        if self._objects:
            return self._put(rel, pieces)
        self._ensure_parent(rel)
        target = self.path(rel)
        # an object store's PUT is atomic already; a local file is written aside, then moved
        tmp = f"{target}.tmp{time.monotonic_ns()}" if self.fs.type_name == "local" else target
        h = hashlib.sha256()
        try:
            with self.fs.open_output_stream(tmp) as out:
                for piece in pieces:
                    h.update(piece)
                    out.write(piece)
            if tmp != target:
                self.fs.move(tmp, target)
        except OSError:      # a full disk, most often: no half-written file left behind
            if tmp != target:
                try:
                    self.fs.delete_file(tmp)
                except OSError:
                    pass
            raise
        return h.hexdigest()

    def _put(self, rel: str, pieces) -> str:
        """One PUT (an object store's PUT is whole or nothing): small bodies from memory, larger
        ones spooled to a local temp file first, never whole in memory."""
        import tempfile

        from . import objects

        h = hashlib.sha256()
        with tempfile.SpooledTemporaryFile(max_size=64 << 20) as spool:
            for piece in pieces:
                h.update(piece)
                spool.write(piece)
            size = spool.tell()
            spool.seek(0)
            body = spool.read() if size <= (64 << 20) else spool
            objects.put(self.path(rel), body, size)
        return h.hexdigest()

    def read_bytes(self, rel: str) -> bytes:
        if self._objects:
            from . import objects

            return objects.get(self.path(rel))
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def read_range(self, rel: str, offset: int, size: int) -> bytes:
        return self.read_ranges(rel, [(offset, size)])[0]

    def read_ranges(self, rel: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """(offset, size) pieces of one file: on an object store a ranged GET each, 8 at a time and no
        HEAD; locally the file opened once."""
        if self._objects:
            from concurrent.futures import ThreadPoolExecutor

            from . import objects

            path = self.path(rel)
            if len(spans) < 2:
                return [objects.get(path, o, n) for o, n in spans]
            with ThreadPoolExecutor(min(8, len(spans))) as pool:
                return list(pool.map(lambda s: objects.get(path, *s), spans))
        with self.fs.open_input_file(self.path(rel)) as f:
            return [f.read_at(n, o) for o, n in spans]

    def download(self, rel: str, local_path) -> str:
        """A file of the run streamed into a local file (never whole in memory); -> its sha256."""
        if self._objects:
            from . import objects

            return objects.download(self.path(rel), local_path)
        h = hashlib.sha256()
        with self.fs.open_input_stream(self.path(rel)) as src, open(local_path, "wb") as out:
            while chunk := src.read(1 << 22):
                h.update(chunk)
                out.write(chunk)
        return h.hexdigest()

    def write_table(self, rel: str, table: pa.Table) -> tuple[str, int]:
        """-> (sha256, bytes) of the Parquet file as written."""
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        data = sink.getvalue().to_pybytes()
        return self.write_bytes(rel, data), len(data)

    def read_table(self, rel: str, columns=None) -> pa.Table:
        if self._objects:      # one GET of the whole file, parsed here (pyarrow would HEAD three times)
            return pq.read_table(pa.BufferReader(self.read_bytes(rel)), columns=columns)
        return pq.read_table(self.path(rel), columns=columns, filesystem=self.fs)

    def read_tables(self, rels: list[str], columns=None) -> list[pa.Table]:
        """`read_table` of each, 32 at a time (a task that reads thousands of small ledgers would
        otherwise wait out each read's latency in turn)."""
        return in_parallel(lambda r: self.read_table(r, columns), rels)

    def exists(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        if self._objects:
            from . import objects

            return objects.head(self.path(rel)) is not None
        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def delete(self, rel: str) -> None:
        """A file, or a folder with everything in it; nothing if neither is there. On an object store
        one listing and a batched delete (no HEADs, no folder marker re-created)."""
        import pyarrow.fs as pafs

        if self._objects:
            from . import objects

            files, _ = objects.listing(self.path(rel), recursive=True)
            objects.delete([self.path(rel)] + [p for p, _ in files])
            return
        info = self.fs.get_file_info(self.path(rel))
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path(rel))
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(self.path(rel))

    def delete_all(self, rels: list[str]) -> None:
        """`delete` of each (files or folders), 16 at a time."""
        from concurrent.futures import ThreadPoolExecutor

        if len(rels) < 2:
            for r in rels:
                self.delete(r)
            return
        with ThreadPoolExecutor(min(16, len(rels))) as pool:
            list(pool.map(self.delete, rels))

    def delete_files(self, rels) -> None:
        """Files of the run (from a listing), deleted together: on an object store 1,000 a request."""
        rels = list(rels)
        if self._objects:
            from . import objects

            objects.delete([self.path(r) for r in rels])
            return
        for r in rels:
            try:
                self.fs.delete_file(self.path(r))
            except FileNotFoundError:
                pass

    def list(self, rel_dir: str, suffix: str = "", recursive: bool = False) -> list[str]:
        """Run-folder-relative paths of the files in rel_dir (directly in it unless recursive), sorted."""
        return [p for p, _ in self.list_sized(rel_dir, suffix, recursive)]

    def list_sized(self, rel_dir: str, suffix: str = "", recursive: bool = False) -> list[tuple[str, int]]:
        """`list`, each path with its size in bytes (a listing has them: no request per file)."""
        import pyarrow.fs as pafs

        base = len(self.root) + 1
        if self._objects:
            from . import objects

            files, _ = objects.listing(self.path(rel_dir), recursive)
            return sorted((p[base:], n) for p, n in files if p.endswith(suffix))
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel_dir), allow_not_found=True,
                                                        recursive=recursive))
        return sorted((i.path[base:], i.size) for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix))

    def entries(self, rel_dir: str) -> tuple[list[str], list[str]]:
        """(`list`, `list_dirs`) of rel_dir from one listing."""
        import pyarrow.fs as pafs

        base = len(self.root) + 1
        if self._objects:
            from . import objects

            files, dirs = objects.listing(self.path(rel_dir), recursive=False)
            return sorted(p[base:] for p, _ in files), sorted(dirs)
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel_dir), allow_not_found=True))
        return (sorted(i.path[base:] for i in infos if i.type == pafs.FileType.File),
                sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory))

    def list_dirs(self, rel_dir: str) -> list[str]:
        """Names of the folders directly in rel_dir (an object store's common prefixes)."""
        return self.entries(rel_dir)[1]

    def write_json(self, rel: str, obj) -> str:
        return self.write_bytes(rel, json.dumps(obj, indent=1, sort_keys=True).encode())

    def read_jsons(self, rels: list[str], default=None) -> list:
        """`read_json` of each, 32 at a time (on an object store each read waits on latency)."""
        return in_parallel(lambda r: self.read_json(r, default), rels)

    def read_json(self, rel: str, default=None):
        """The JSON at rel; `default` if there is none or it is not whole JSON (a torn write). One
        read: a missing file is the read's own answer, not a look first."""
        try:
            return json.loads(self.read_bytes(rel))
        except (FileNotFoundError, ValueError):
            return default

    def put_dir(self, rel: str, local_dir) -> dict[str, str]:
        """Copy a local folder's files (not sub-folders) to rel. -> {file name: sha256}."""
        from pathlib import Path

        return {f.name: self.write_bytes(f"{rel}/{f.name}", f.read_bytes())
                for f in sorted(Path(local_dir).iterdir()) if f.is_file()}

    def is_folder(self, local_dir) -> bool:
        """Whether this storage is that local folder (a working copy of it is then itself)."""
        return self.is_local and Path(self.root) == Path(local_dir).resolve()

    def copy_to(self, local_dir, rels: list[str]) -> None:
        """Files of the run into a local folder (the driver's working copy), unless it is this storage."""
        if self.is_folder(local_dir):
            return
        for rel in rels:
            (Path(local_dir) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(local_dir) / rel).write_bytes(self.read_bytes(rel))

    def write_both(self, local_dir, rel: str, data: bytes) -> str:
        """Write here and, where the working copy is another folder, there too (for tools reading it)."""
        sha = self.write_bytes(rel, data)
        if not self.is_folder(local_dir):
            (Path(local_dir) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(local_dir) / rel).write_bytes(data)
        return sha

    def pin_copies(self, folder: str, paths: list, digests: list[str]) -> list[str | None]:
        """Local files workers on other machines must read: copied into an object-store run folder
        as `<folder>/<digest[:16]>-<name>`, each only if not there yet (named by its content, an
        unchanged file is never uploaded again); copies in `folder` of files no longer given are
        deleted together. -> each file's run-relative path, or None where workers reach the local
        path as it is."""
        from pathlib import Path

        if self.is_local:
            return [None] * len(paths)
        rels = [f"{folder}/{d[:16]}-{Path(p).name}" for p, d in zip(paths, digests)]
        have = set(self.list(folder))
        for path, rel in zip(paths, rels):
            if rel not in have:
                self.write_file(rel, path)
        self.delete_files(sorted(have - set(rels)))
        return rels

    def local_dir(self, rel: str):
        """A folder of the run as a local path this process can open: itself for a local run folder,
        else a copy fetched once per process (for model folders: libraries that want a path)."""
        from pathlib import Path

        if self.is_local:
            return Path(self.path(rel))
        return _fetched(self, rel)


_FETCHED: dict = {}


def _fetched(storage: "Storage", rel: str):
    """Download rel's files into a temp folder of this process, once per content (names, sizes and
    modification times: a folder rewritten in place is fetched again)."""
    import tempfile
    from pathlib import Path

    import pyarrow.fs as pafs

    infos = [i for i in storage.fs.get_file_info(pafs.FileSelector(storage.path(rel), allow_not_found=True))
             if i.type == pafs.FileType.File]
    if not infos:
        raise FileNotFoundError(f"{storage.uri(rel)}: no files there")
    files = sorted(i.path[len(storage.root) + 1:] for i in infos)
    key = (storage.uri(rel), tuple(sorted((i.path, i.size, i.mtime_ns) for i in infos)))
    if key not in _FETCHED:
        if not _FETCHED:      # the copies go when the process ends (they were left in /tmp, one per worker)
            import atexit

            atexit.register(_remove_fetched)
        out = Path(tempfile.mkdtemp(prefix="capline-fetch-"))
        for f in files:
            (out / f.rsplit("/", 1)[-1]).write_bytes(storage.read_bytes(f))
        _FETCHED[key] = out
    return _FETCHED[key]


def _remove_fetched() -> None:
    import shutil

    for out in _FETCHED.values():
        shutil.rmtree(out, ignore_errors=True)
    _FETCHED.clear()


# -- paths that may be URIs ------------------------------------------------------------------------
SCHEMES = ("s3://", "gs://")


def in_parallel(fn, rels: list[str], at_once: int = 32) -> list:
    """`fn(rel)` of each (requests to the store: threads wait on them side by side), results in
    order, `at_once` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    if len(rels) < 2:
        return [fn(r) for r in rels]
    with ThreadPoolExecutor(min(at_once, len(rels))) as pool:
        return list(pool.map(fn, rels))


def is_uri(path) -> bool:
    return isinstance(path, str) and path.startswith(SCHEMES)


def filesystem(uri: str):
    """-> (pyarrow FileSystem, path inside it). S3's is made to send no folder checks and to retry
    throttling with AWS's standard backoff for longer than its default three attempts (what opens
    it as files: Ray Data, Parquet filter reads, training; Storage's own calls use infra/objects.py)."""
    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(uri)
    if fs.type_name == "s3":
        # the options from_uri found (endpoint, region, scheme from the URI and the environment), kept;
        # a longer retry added (it does not survive pickling: a task's copy retries 3 times, which
        # only matters for what opens `fs` directly)
        opts = dict(fs.__reduce__()[1][0])
        if not opts.get("proxy_options", {}).get("host"):
            opts.pop("proxy_options", None)
        opts = {k: v for k, v in opts.items() if v not in ("", None) or k == "region"}
        fs = pafs.S3FileSystem(**opts, retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=12))
    return fs, path


def join(base, *parts: str):
    return "/".join([str(base).rstrip("/"), *parts]) if is_uri(base) else Path(base).joinpath(*parts)


def list_files(uri: str, suffix: str = "") -> list[str]:
    import pyarrow.fs as pafs

    fs, root = filesystem(uri)
    scheme = uri.split("://", 1)[0] + "://"
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=False, allow_not_found=True))
    return sorted(scheme + i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix))


def open_input(path):
    """A readable binary stream for a local path or a URI (sequential reads only for URIs)."""
    if is_uri(path):
        fs, p = filesystem(path)
        return fs.open_input_stream(p)
    return open(path, "rb")


def file_size(path) -> int:
    """Bytes of a local file or an object."""
    if is_uri(path):
        fs, p = filesystem(path)
        return fs.get_file_info(p).size
    return Path(path).stat().st_size


def read_range_of(path, offset: int, size: int) -> bytes:
    """`size` bytes from `offset` of a local file or an object: one ranged read."""
    if is_uri(path):
        fs, p = filesystem(path)
        with fs.open_input_file(p) as f:
            return f.read_at(size, offset)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)
