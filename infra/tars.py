"""Tars, read one way: untrusted tars member by member, sample by sample, and stored tars by range.

- `tar_members`: the members of an untrusted tar, refusing what a dataset tar never holds.
- `tar_samples`: a WebDataset tar streamed (uncompressed, never seeked) as samples: the consecutive
  members sharing a key, (key, {extension: bytes}).
- `read_members`: members of stored tars by byte range, in few large requests (below).
- `SampleTarWriter`: the one tar writer (ingest's downloads, the shard stage, removals' rewrites).

Reading members of stored tars by byte range, in few large requests.

The sample index (ingest) records, for each image, its tar, byte offset and size. Reading each image
with its own ranged request costs one object-store GET per image per stage; here the rows of one
tar are sorted by offset and merged into spans (a gap up to `max_gap` bytes is read and thrown
away, a span stops growing at `max_span`), and each span is one `read_at`: a task that reads a whole
partition issues one request per tar, a task that reads a few scattered samples one per sample.
"""
from __future__ import annotations

import tarfile

from .errors import UserError

MAX_MEMBER_BYTES = 64 * 2**20   # an image or caption larger than this in a tar is not one


class SampleTarWriter:
    """Samples as WebDataset members (`<key>.<ext>`) into an open binary file, USTAR headers with
    nothing of the machine or the clock in them (mtime 0, mode 0444, no owner): the same samples
    make the same bytes, wherever and whenever they are written."""

    def __init__(self, fileobj):
        self.file = fileobj
        self.tar = tarfile.open(fileobj=fileobj, mode="w", format=tarfile.USTAR_FORMAT)

    def add(self, key: str, members) -> int:
        """members: (extension, bytes) in the order to write them -> the sample's byte offset."""
        import io

        offset = self.file.tell()
        for ext, data in members:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), 0, 0o444
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            self.tar.addfile(info, io.BytesIO(data))
        return offset

    def close(self) -> None:
        self.tar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def tar_members(tar: tarfile.TarFile, where, max_bytes: int = MAX_MEMBER_BYTES):
    """The members of an untrusted tar, refusing what a dataset tar never holds: a link (it can
    name any file), a device, FIFO or other special file, a GNU sparse member (a few KB on disk
    that read as gigabytes) and a member over `max_bytes`. Folders are passed over. The one tar
    reader every capline stage and tool uses."""
    last = -1
    for m in tar:
        # a negative size or a header at or before the last one is how tars that make Python 3.11.7's
        # tarfile walk backwards are built (CVE-2025-8194): refused before it takes the next step
        if m.size < 0 or m.offset <= last:
            raise UserError(f"{where}: member {m.name!r} has a negative size or a header that goes backwards; "
                            "not a valid tar")
        last = m.offset
        if m.isdir():
            continue
        kind = ("a link" if m.issym() or m.islnk() else "a sparse member" if m.issparse()
                else None if m.isreg() else "a device or special file")
        if kind:
            raise UserError(f"{where}: member {m.name!r} is {kind}; a dataset tar holds regular files only")
        if m.size > max_bytes:
            raise UserError(f"{where}: member {m.name!r} is {m.size} bytes, over the {max_bytes}-byte limit "
                            "for one sample's file")
        yield m


def sample_key(name: str) -> tuple[str, str]:
    """A member's (sample key, extension): the name up to the first dot of its last component."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext


# gzip, bzip2 (with its first block's magic: a member may be named "BZh..."), xz, zstd: none can
# start a tar header, whose first bytes are a member's printable name
COMPRESSED_MAGIC = (b"\x1f\x8b", *(b"BZh%d1AY&SY" % level for level in range(1, 10)), b"\xfd7zXZ\x00",
                    b"\x28\xb5\x2f\xfd")


class _Prefixed:
    """A stream whose first bytes were read already (to look at them): those, then the rest."""

    def __init__(self, head: bytes, rest):
        self.head, self.rest = head, rest

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return self.rest.read(size)
        if size is None or size < 0:
            out, self.head = self.head + self.rest.read(), b""
            return out
        out, self.head = self.head[:size], self.head[size:]
        return out + (self.rest.read(size - len(out)) if len(out) < size else b"")


def tar_samples(path, where=None):
    """(key, {extension: bytes}) for each sample of a WebDataset tar at `path` (a local path, a URI,
    or a readable file object holding part of a tar from a member's header on), streamed in order;
    members of one sample are consecutive, as webdataset writes them."""
    import contextlib

    from .storage import open_input

    opened = contextlib.nullcontext(path) if hasattr(path, "read") else open_input(path)
    with opened as stream:
        head = stream.read(10)
        if any(head.startswith(magic) for magic in COMPRESSED_MAGIC):
            # checked by its bytes, not left to the tar parser: a gzip header's bytes pass as a tar
            # header's checksum for about 1 in 400 timestamps, and the rest would be read as members
            raise UserError(f"{where or path}: not an uncompressed tar (it starts as a compressed file does); "
                            "capline reads dataset tars uncompressed, so decompress it first")
        stream = _Prefixed(head, stream)
        try:
            tar = tarfile.open(fileobj=stream, mode="r|")
        except tarfile.ReadError as err:
            raise UserError(f"{where or path}: not an uncompressed tar ({err}); capline reads dataset tars "
                            "uncompressed, so decompress it first") from None
        current, parts = None, {}
        try:
            for m in tar_members(tar, where or path):
                key, ext = sample_key(m.name)
                if key != current and current is not None:
                    yield current, parts
                    parts = {}
                current = key
                parts[ext] = tar.extractfile(m).read()
        except (tarfile.TarError, EOFError) as err:   # cut short, or a header that does not parse
            raise UserError(f"{where or path}: truncated or not a valid tar ({err})") from None
        if current is not None:
            yield current, parts
        tar.close()


MAX_GAP = 8 << 20      # read through up to 8 MiB of other members rather than issue another request
MAX_SPAN = 256 << 20   # but hold no more than this in memory for one request
IN_FLIGHT_BYTES = 512 << 20   # spans of several tars read at once, up to this much together
TARS_AT_ONCE = 16             # tars read at once (each a request or a few in flight)


def plan_spans(offsets: list[int], sizes: list[int], max_gap: int = MAX_GAP,
               max_span: int = MAX_SPAN) -> list[tuple[int, int, list[int]]]:
    """Rows (indexes into offsets/sizes) grouped into spans -> [(start, end, rows)], by offset."""
    spans: list[tuple[int, int, list[int]]] = []
    for i in sorted(range(len(offsets)), key=lambda i: offsets[i]):
        lo, hi = offsets[i], offsets[i] + sizes[i]
        if spans and lo - spans[-1][1] <= max_gap and max(hi, spans[-1][1]) - spans[-1][0] <= max_span:
            start, end, rows = spans[-1]
            spans[-1] = (start, max(end, hi), rows + [i])
        else:
            spans.append((lo, hi, [i]))
    return spans


def read_members(storage, tars: list, offsets: list, sizes: list, counter: dict | None = None,
                 max_gap: int = MAX_GAP, max_span: int = MAX_SPAN) -> list[bytes | None]:
    """The bytes of each row's member (None where the row has no tar or offset), each tar opened once
    and read in spans. `counter`, if given, counts the requests made (`requests`) and bytes read."""
    out: list[bytes | None] = [None] * len(tars)
    by_tar: dict[str, list[int]] = {}
    for i, t in enumerate(tars):
        if t is not None and offsets[i] is not None:
            by_tar.setdefault(t, []).append(i)
    planned = {t: plan_spans([offsets[i] for i in rows], [sizes[i] for i in rows], max_gap, max_span)
               for t, rows in by_tar.items()}

    def read(t):
        """One tar's spans, a ranged read each (on an object store a GET, no HEAD), cut into its rows'
        members in this thread, so no more than the spans in flight are held beside the members."""
        spans = planned[t]
        rows = by_tar[t]
        got = []
        for (start, _, members), data in zip(spans, storage.read_ranges(t, [(s, e - s) for s, e, _ in spans])):
            got.append(len(data))
            for j in members:
                i = rows[j]
                out[i] = data[offsets[i] - start: offsets[i] - start + sizes[i]]
        return got

    # several tars at once (picks spread over many small shards are as many requests, never one
    # after another): up to TARS_AT_ONCE, and IN_FLIGHT_BYTES of planned spans, a new one started as
    # each finishes (waves that waited for their slowest read took 2x as long behind a store's latency)
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    size_of = {t: sum(e - s for s, e, _ in planned[t]) for t in planned}
    todo = iter(planned)
    nxt = next(todo, None)
    running: dict = {}
    held = 0
    with ThreadPoolExecutor(TARS_AT_ONCE) as pool:
        while nxt is not None or running:
            while nxt is not None and len(running) < TARS_AT_ONCE and (not running or held + size_of[nxt] <= IN_FLIGHT_BYTES):
                running[pool.submit(read, nxt)] = nxt
                held += size_of[nxt]
                nxt = next(todo, None)
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                held -= size_of[running.pop(f)]
                lengths = f.result()
                if counter is not None:
                    counter["requests"] = counter.get("requests", 0) + len(lengths)
                    counter["bytes"] = counter.get("bytes", 0) + sum(lengths)
    return out
