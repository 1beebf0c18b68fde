"""Compression and dictionary bombs: how many bytes a file's values become once read, measured
before they are.

A Parquet file stores a repeated value once (a dictionary) and a text list compresses a repeated
line to nothing: 83 KB of Parquet became 5.9 GB in memory, 852 KB of gzip 4.5 GB. Every reader of
a list or an evaluation set asks here first; the limit is what the file may become: `expansion`
times its size on disk (a real list decodes to a few times its size; a bomb to thousands), at least
FLOOR, at most `max_bytes`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .errors import UserError

FLOOR = 64 << 20           # any file may become this much
EXPANSION = 100            # ... or this many times its size on disk


def limit_for(path: Path, max_bytes: int | None = None, expansion: float = EXPANSION) -> int:
    size = Path(path).stat().st_size
    limit = max(FLOOR, int(expansion * size))
    return min(limit, max_bytes) if max_bytes else limit


def text_columns(schema: pa.Schema) -> list[str]:
    """The columns of text or bytes (also those a writer stored as dictionaries of them)."""
    def texty(t) -> bool:
        t = t.value_type if pa.types.is_dictionary(t) else t
        return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)

    return [f.name for f in schema if texty(f.type)]


def decoded_lengths(arr) -> np.ndarray:
    """Each value's length in bytes (0 for null), without decoding a dictionary column."""
    if pa.types.is_dictionary(arr.type):
        lengths = pc.fill_null(pc.binary_length(arr.dictionary), 0).to_numpy(zero_copy_only=False)
        idx = pc.fill_null(arr.indices, 0).to_numpy(zero_copy_only=False)
        out = lengths[idx] if len(lengths) else np.zeros(len(arr), np.int64)
        return np.where(arr.is_null().to_numpy(zero_copy_only=False), 0, out).astype(np.int64)
    return pc.fill_null(pc.binary_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)


def _leaf_index(pf, path: str) -> int:
    return next(i for i in range(len(pf.schema)) if pf.schema.column(i).path == path)


def _nested_bytes(arr) -> int:
    """The text and binary bytes of a column once decoded, through lists and structs, counting each
    dictionary value once per use and decoding none."""
    t = arr.type
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _nested_bytes(arr.flatten())
    if pa.types.is_struct(t):
        return sum(_nested_bytes(arr.field(i)) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _nested_bytes(arr.keys) + _nested_bytes(arr.items)
    v = t.value_type if pa.types.is_dictionary(t) else t
    if pa.types.is_string(v) or pa.types.is_large_string(v) or pa.types.is_binary(v) or pa.types.is_large_binary(v):
        return int(decoded_lengths(arr).sum())
    return 0


def check_parquet(path: Path, what: str, setting: str, max_bytes: int | None = None,
                  expansion: float = EXPANSION) -> int:
    """Refuses (one line, naming the file and `setting`) a Parquet file whose text and binary values
    pass `limit_for(path)` once decoded; reads them as dictionaries, a batch at a time, decoding
    nothing. -> the decoded bytes."""
    limit = limit_for(path, max_bytes, expansion)

    def refuse():
        raise UserError(f"{what}: {path} holds more than {limit:,} bytes of values once decoded, from "
                        f"{Path(path).stat().st_size:,} bytes on disk (a dictionary bomb?); {setting}")

    try:
        pf = pq.ParquetFile(path)
        # pages as stored, uncompressed: a value repeated and compressed away (what a writer does
        # when a dictionary outgrows its page) shows here without reading a page
        if sum(pf.metadata.row_group(i).total_byte_size for i in range(pf.metadata.num_row_groups)) > limit:
            refuse()
        # nested columns (list<string>, struct): a row holds any number of leaf values, each at
        # least an offset (8 bytes) once read, however few bytes its run-length encoding took
        md = pf.metadata
        nested = [(md.row_group(i).column(j).path_in_schema, md.row_group(i).column(j).num_values)
                  for i in range(md.num_row_groups) for j in range(md.num_columns)
                  if "." in md.row_group(i).column(j).path_in_schema]
        if 8 * sum(n for _, n in nested) > limit:
            refuse()
        texty = text_columns(pf.schema_arrow)
        leaves = sorted({p for p, _ in nested if pf.schema.column(_leaf_index(pf, p)).physical_type == "BYTE_ARRAY"})
        tops = texty + sorted({p.split(".")[0] for p in leaves})
        if not tops:
            return 0
        # a dictionary's values count once on disk and once per row in memory: summed from the
        # dictionary and its indices, a small batch at a time, never decoded
        pf = pq.ParquetFile(path, read_dictionary=texty + leaves)
        total = 0
        for batch in pf.iter_batches(batch_size=4096, columns=tops):
            total += sum(_nested_bytes(batch.column(n)) for n in tops)
            if total > limit:
                refuse()
        return total
    except (pa.ArrowInvalid, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{what}: {path} is not a readable Parquet file ({first})") from None


# JSON nesting a JSONL line may have: pyarrow's reader recurses per level and a line nested 20,000
# deep killed the reading process (SIGSEGV, no error); 5,000 still read
MAX_JSON_DEPTH = 1000


def json_depths(data: bytes, carried: int = 0) -> tuple[int, int]:
    """(deepest, at the end) bracket nesting of JSONL `data`, counted per line from `carried` (the
    depth the previous chunk ended at). Brackets inside strings count too: an upper bound."""
    if not data:
        return carried, carried
    a = np.frombuffer(data, np.uint8)
    depth = np.cumsum(((a == 91) | (a == 123)).astype(np.int32) - ((a == 93) | (a == 125)).astype(np.int32)) + carried
    newline = np.maximum.accumulate(np.where(a == 10, np.arange(len(a)), -1))
    depth -= np.where(newline >= 0, depth[np.maximum(newline, 0)], 0)
    return int(depth.max()), int(depth[-1])


class Counted:
    """A readable stream that counts what passes and refuses past `limit` bytes (a compressed text
    list, decompressed as it is read); with `json`, also a line nested past MAX_JSON_DEPTH."""

    def __init__(self, raw, limit: int, what: str, json: bool = False):
        self.raw, self.limit, self.what, self.n = raw, limit, what, 0
        self.json, self.depth = json, 0
        self.closed = False

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.n += len(data)
        if self.n > self.limit:
            raise UserError(f"{self.what}: more than {self.limit:,} bytes once decompressed")
        if self.json:
            deepest, self.depth = json_depths(data, self.depth)
            if deepest > MAX_JSON_DEPTH:
                raise UserError(f"{self.what.split(':')[0]}: a line nests JSON more than {MAX_JSON_DEPTH} levels "
                                f"deep (near byte {self.n - len(data):,}): not a URL list's row")
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True
        self.raw.close()
