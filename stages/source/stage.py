"""The source stage: turn the configured source into partitions of a URL list, `source/ledger/*.parquet`.

- `kind: synthetic` generates the demo's captioned scenes (stages/source/synthetic.py), served later over
  loopback by the ingest stage.
- `kind: openclipart` renders Debian's openclipart-svg drawings, captioned by their titles and
  keywords (stages/source/openclipart.py), served like the demo over loopback; `limit` takes a seeded subset.
- `kind: urls` reads a user's URL list (Parquet, CSV, TSV or JSON lines) with `url_col` and
  `caption_col`, as CC3M / CC12M / DataComp / LAION metadata come. `path` may be one file or a
  folder of partition files (read in name order; a new file is a new partition, see ingest).
  Rows without a usable URL are dropped here with a reason; a file that cannot be read, or lacks a
  named column, is an error.

Every sample gets a stable key (no dots: WebDataset splits on them): `key_col` if given, else a
hash of URL and caption (a repeat of the same pair within a file gets a `_N` suffix).

A URL list is read by the workers: a Ray task per file computes the keys and writes the file's
partitions (`rows_per_part` rows each) itself; the driver learns only their counts. The generated
sources (synthetic, openclipart) build their files on the driver, as the loopback server that
serves them runs there too, and are partitioned the same way.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from infra.bombs import Counted, check_parquet, decoded_lengths, limit_for, text_columns
from infra.configtools import join, require
from infra.errors import UserError

from . import openclipart

from . import synthetic
from infra.hashing import file_sha256

from .. import records
from ..base import Source, StageContext, StageResult
from ..dataplane import DROPPED, KEPT, PartResult, write_part
from .keys import BASES, CHECKED, base_hashes, bases_table, unique_across_files


@dataclass
class DefectFractions:
    """Share of demo samples given each planted defect (a value >= 1 is an absolute count)."""
    mismatched_caption: float = 0.06
    non_english: float = 0.06
    eval_near_copy: float = 0.04
    http_404: float = 0.01
    http_500: float = 0.01
    timeout: float = 0.005
    corrupt: float = 0.01
    truncated: float = 0.01
    non_image: float = 0.01
    tiny: float = 0.01
    empty_caption: float = 0.01
    huge_pixels: float = 2
    huge_bytes: float = 2
    repeat_row: float = 0.01        # the same URL and caption as an earlier sample
    train_near_copy: float = 0.01   # an earlier sample's image re-encoded, with its caption
    eval_caption: float = 0.02      # a held-out caption in the alt-text: exact, re-cased, inside longer text

    def validate(self, prefix: str) -> None:
        total = 0.0
        for name, value in vars(self).items():
            require(value >= 0, join(prefix, name), f"must be >= 0, got {value}")
            total += value if value < 1 else 0
        require(total < 0.9, prefix, f"fractions add up to {total:.2f}; keep them under 0.9")


@dataclass
class SourceConfig:
    kind: Literal["synthetic", "urls", "openclipart"] = "synthetic"  # where samples come from: a URL list (urls), the generated demo (synthetic), openclipart SVGs
    # kind: urls (the list) or openclipart (the SVG folder; default /usr/share/openclipart/svg)
    path: str | None = None
    format: Literal["auto", "parquet", "csv", "tsv", "jsonl"] = "auto"  # the list's format; auto: from the file name (.parquet, .csv, .tsv, .jsonl, compressed too)
    # a column by name, or by position (0 = first): CC3M/CC12M's TSVs come without a header
    url_col: str | int = "url"
    caption_col: str | int = "caption"  # the column of captions (alt-text), by name or position
    key_col: str | int | None = None  # the list's own unique id column (keys in the ledger and shards); null: a hash of URL and caption
    header: bool = True              # csv/tsv: false when the first line is already a row
    columns: list[str] | None = None  # csv/tsv without a header: names for its columns, in order
    # other columns carried into each sample's JSON (LICENSE, WIDTH, similarity, punsafe, ...):
    # null: every other column of a Parquet list, none of a text list; [] none; values over
    # 1,000 characters are left out
    keep_columns: list[str | int] | None = None
    carried_bytes: int = 4096        # JSON a sample carries from its list's columns at most; the rest left out, counted
    # a row with a field (URL, caption, any column) longer than this is set aside as
    # malformed_row:field_too_large
    max_field_bytes: int = 1 << 20
    # a list file whose text (decompressed) or decoded Parquet values pass this, or 100 times its
    # size on disk (infra/bombs.py), is refused before a row is keyed: a compression or dictionary
    # bomb is measured first (a pass that decodes nothing)
    max_list_bytes: int = 8 << 30
    # bounds on the list's own numeric columns, each a declared threshold (LAION's recipe:
    # {punsafe: {max: 0.5}, pwatermark: {max: 0.8}, WIDTH: {min: 256}}): a row outside one, or without
    # a number there, is dropped as list_filter:<column>, naming the value and the bound
    where: dict[str, dict[str, float]] = field(default_factory=dict)
    # kind: synthetic
    num_samples: int = 2000
    eval_size: int = 300  # held-out demo scenes for evaluation (never served)
    image_size: int = 96  # side of the demo's generated images, in pixels
    slow_seconds: float = 6.0  # the demo's slow URLs answer after this long (a planted timeout)
    serve_port: int = 8431           # loopback port a served source (synthetic, openclipart) is fetched from; 0: any
    huge_pixels: int = 16000  # side of the demo's planted huge-pixel PNG
    huge_bytes: int = 3_000_000  # size of the demo's planted huge-bytes file
    defects: DefectFractions = field(default_factory=DefectFractions)
    # kind: openclipart
    limit: int | None = None         # a seeded subset of this many drawings (null: all 8,121)
    render_size: int = 128           # longest side of the rendered PNG
    rows_per_part: int = 100_000     # a partition of the URL list: the unit every later stage works in

    @property
    def served(self) -> bool:
        """Whether ingest must serve this source's files itself over loopback."""
        return self.kind in ("synthetic", "openclipart")

    def validate(self, prefix: str) -> None:
        require(self.num_samples > 0, join(prefix, "num_samples"),
                f"must be a positive number of samples, got {self.num_samples}")
        require(self.eval_size > 0, join(prefix, "eval_size"), f"must be positive, got {self.eval_size}")
        require(16 <= self.image_size <= 1024, join(prefix, "image_size"),
                f"must be between 16 and 1024 pixels, got {self.image_size}")
        if self.kind == "urls":
            require(bool(self.path), join(prefix, "path"), "kind 'urls' needs the path of a URL list file")
        require(self.limit is None or self.limit > 0, join(prefix, "limit"), f"must be > 0 or null, got {self.limit}")
        require(16 <= self.render_size <= 2048, join(prefix, "render_size"), "must be 16..2048 pixels")
        require(0 <= self.serve_port <= 65535, join(prefix, "serve_port"), f"must be 0..65535, got {self.serve_port}")
        require(self.rows_per_part >= 1, join(prefix, "rows_per_part"), f"must be >= 1, got {self.rows_per_part}")
        require(64 <= self.carried_bytes <= 65536, join(prefix, "carried_bytes"), f"must be 64..65536, got {self.carried_bytes}")
        require(1024 <= self.max_field_bytes <= 1 << 28, join(prefix, "max_field_bytes"),
                f"must be 1024..268435456, got {self.max_field_bytes}")
        require(self.max_list_bytes >= 1 << 20, join(prefix, "max_list_bytes"), f"must be >= 1048576, got {self.max_list_bytes}")
        for name in ("url_col", "caption_col", "key_col"):
            v = getattr(self, name)
            require(not isinstance(v, int) or isinstance(v, bool) or v >= 0, join(prefix, name),
                    f"a column position counts from 0, got {v}")
        for col, bounds in self.where.items():
            at = join(prefix, f"where.{col}")
            require(isinstance(bounds, dict) and bool(bounds) and set(bounds) <= {"min", "max"}, at,
                    f"bounds as {{min: X, max: Y}} (either or both), got {bounds!r}")
            for k, v in bounds.items():
                require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), at,
                        f"{k} must be a finite number, got {v!r}")
            require(bounds.get("min", -math.inf) <= bounds.get("max", math.inf), at, f"min > max in {bounds}")
        require(self.columns is None or not self.header, join(prefix, "columns"),
                "names columns of a file without a header: set source.header: false too (or drop columns)")


def column_ref(col, names: list[str], what: str) -> str | None:
    """A configured column (a name, or a position counting from 0) as the file's column name."""
    if col is None:
        return None
    if isinstance(col, int) and str(col) not in names:
        if col >= len(names):
            raise UserError(f"source.{what}: column position {col}, but the file has {len(names)} column(s)")
        return names[col]
    return str(col)


def _format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    # a compressed text list (.gz, .zst, .bz2): pyarrow decompresses it by its suffix as it reads
    compressed = path.suffix.lower() in COMPRESSED
    suffix = "".join(path.suffixes[-2:]) if compressed else path.suffix
    base = path.suffixes[-2] if compressed and len(path.suffixes) > 1 else path.suffix
    fmt = {".parquet": "parquet", ".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl"}.get(base.lower(), "")
    if compressed and fmt == "parquet":
        fmt = ""
    if not fmt:
        raise UserError(f"source.path {path}: cannot tell the format from '{suffix}'; "
                        "set source.format to parquet, csv, tsv or jsonl")
    return fmt


def _read_options(header: bool, columns: list[str] | None):
    if columns:
        return pacsv.ReadOptions(column_names=list(columns))
    return pacsv.ReadOptions(autogenerate_column_names=not header)


def _positional(table: pa.Table, header: bool, columns) -> pa.Table:
    """A headerless file's autogenerated names (f0, f1, ...) as positions ("0", "1", ...)."""
    if header or columns:
        return table
    return table.rename_columns([str(i) for i in range(table.num_columns)])


BATCH_ROWS = 65_536               # rows of a Parquet list decoded at once
BATCH_BYTES = 256 << 20           # ... and at most this many bytes of their text values


def iter_list(path: Path, fmt: str, text_cols: tuple = (), header: bool = True, columns=None,
              max_field: int = 1 << 20, max_bytes: int = 64 << 30):
    """A URL list file, a batch at a time (memory: a batch, whatever the file's size) -> (rows, each
    row's 1-based line in the file or None for Parquet, the lines that are not rows: [{line,
    expected, actual, text}]). A CSV/TSV line with too few or too many columns (a URL without a
    caption, a tab inside a caption: real CC3M/CC12M lists have them) is set aside with its line
    number, never a reason to refuse the whole list. Past `max_bytes` of text (decompressed) or of
    decoded Parquet values, the file is refused; a row with a field over `max_field` is set aside
    (keyed_rows)."""
    fmt = _format(path, fmt)
    try:
        if fmt == "parquet":
            yield from _parquet_batches(path, max_bytes)
            return
        limit = limit_for(path, max_bytes) if path.suffix.lower() in COMPRESSED else max_bytes
        what = (f"source.path {path}: {path.stat().st_size:,} bytes on disk (a compression bomb?); raise "
                "source.max_list_bytes if the list is real")
        if path.suffix.lower() in COMPRESSED:     # a bomb is measured before a row is keyed or written
            with pa.input_stream(str(path), compression="detect") as raw:
                counted = Counted(raw, limit, what)
                while counted.read(16 << 20):
                    pass
        block = max(1 << 20, 4 * max_field)
        with pa.input_stream(str(path), compression="detect") as raw:
            stream = Counted(raw, limit, what, json=fmt == "jsonl")
            if fmt == "jsonl":
                reader = pajson.open_json(stream, read_options=pajson.ReadOptions(block_size=block, use_threads=False))
                line = 1
                for batch in reader:
                    n = batch.num_rows
                    yield pa.Table.from_batches([batch]), list(range(line, line + n)), []
                    line += n
                return
            # text columns as bytes, decoded per row (texts()): type inference would turn an invalid
            # byte into a binary column, or a column of numbers-looking captions into floats
            names = None if header or columns else _read_columns(path, fmt, header, columns)
            wanted = {(f"f{names.index(c)}" if names is not None and c in names else c) for c in text_cols}
            convert = pacsv.ConvertOptions(column_types={c: pa.binary() for c in wanted})
            malformed: list[dict] = []

            def set_aside(row) -> str:
                malformed.append({"line": row.number, "expected": row.expected_columns, "actual": row.actual_columns,
                                  "text": (row.text or "")[:200]})
                return "skip"

            # one thread: only then does pyarrow know each bad line's number; empty lines kept as
            # rows, so that rows and bad lines together are the file's lines (a caption quoted over
            # several lines is the one case that shifts the numbers after it)
            parse = pacsv.ParseOptions(delimiter="\t" if fmt == "tsv" else ",", invalid_row_handler=set_aside,
                                       ignore_empty_lines=False)
            options = _read_options(header, columns)
            options.use_threads, options.block_size = False, block
            reader = pacsv.open_csv(stream, read_options=options, parse_options=parse, convert_options=convert)
            bad: set[int] = set()
            line = 2 if header and not columns else 1
            for batch in reader:
                found, malformed[:] = list(malformed), []
                bad |= {m["line"] for m in found}
                lines = []
                for _ in range(batch.num_rows):
                    while line in bad:
                        line += 1
                    lines.append(line)
                    line += 1
                yield _positional(pa.Table.from_batches([batch]), header, columns), lines, found
            if malformed:      # lines set aside after the last batch
                yield None, [], list(malformed)
    except UserError:
        raise
    except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"source.path {path}: not a readable {fmt} URL list ({first})") from None


def _parquet_batches(path: Path, max_bytes: int):
    """A Parquet list's rows a batch at a time, its text columns read as dictionaries where the file
    has them (a dictionary bomb, one long value repeated, stays small until a batch is decoded) and
    each batch cut so that its decoded text stays under BATCH_BYTES; past `max_bytes` decoded in
    all, the file is refused."""
    check_parquet(path, "source.path", "raise source.max_list_bytes if the list is real", max_bytes)   # measured first
    texty = text_columns(pq.ParquetFile(path).schema_arrow)
    pf = pq.ParquetFile(path, read_dictionary=texty)
    for batch in pf.iter_batches(batch_size=BATCH_ROWS):
        sizes = np.zeros(batch.num_rows, np.int64)
        for name in texty:
            sizes += decoded_lengths(batch.column(name))
        start = 0
        while start < batch.num_rows:      # slices whose decoded text fits BATCH_BYTES (at least a row)
            cum = np.cumsum(sizes[start:])
            stop = start + max(1, int(np.searchsorted(cum, BATCH_BYTES, side="right")))
            piece = pa.Table.from_batches([batch.slice(start, stop - start)])
            yield _decoded(piece, texty), None, []
            start = stop


def _decoded(table: pa.Table, texty: list[str]) -> pa.Table:
    """Dictionary columns back to plain values (one batch's worth)."""
    for name in texty:
        col = table.column(name)
        if pa.types.is_dictionary(col.type):
            table = table.set_column(table.column_names.index(name), name, col.cast(col.type.value_type))
    return table


def _read_columns(path: Path, fmt: str, header: bool = True, columns=None) -> list[str]:
    """The file's column names, from its header or metadata alone: preflight reads no rows. A file
    without a header has its columns' positions ("0", "1", ...) or the names `columns` gives."""
    fmt = _format(path, fmt)
    try:
        if fmt == "parquet":
            return pq.read_schema(path).names
        with pa.input_stream(str(path), compression="detect") as f:
            head = f.read(1 << 20)
        if fmt in ("csv", "tsv"):
            # the first record, parsed here: Arrow's CSV reader reads ahead on its own threads, and
            # a preflight that refuses the run ends the process while they may still be starting,
            # which has aborted it at exit ("terminate called without an active exception",
            # apache/arrow#34314; once in CI). A malformed line later is the row reader's to count.
            if not head.strip():
                raise UserError(f"source.path {path}: not a readable {fmt} URL list (the file is empty)")
            if columns:
                return list(columns)
            # rows may hold bytes that are not UTF-8 (each costs its row later): only the header must be
            text = head.removeprefix(b"\xef\xbb\xbf").decode("utf-8", "surrogateescape")   # Arrow skips a BOM too
            csv.field_size_limit(max(csv.field_size_limit(), len(text) + 1))
            names = next(csv.reader(io.StringIO(text), delimiter="\t" if fmt == "tsv" else ","), [])
            if not header:
                return [str(i) for i in range(len(names))]
            try:
                "".join(names).encode("utf-8")    # a byte surrogateescape stood in for does not encode
            except UnicodeEncodeError:
                raise UserError(f"source.path {path}: not a readable {fmt} URL list (its header is not UTF-8)") from None
            return names
        first = head.split(b"\n", 1)[0]
        one = pajson.ReadOptions(use_threads=False)   # in this thread, for the reason above
        return pajson.read_json(pa.BufferReader(first), read_options=one).column_names if first.strip() else []
    except (pa.ArrowInvalid, OSError, UnicodeDecodeError, csv.Error) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"source.path {path}: not a readable {fmt} URL list ({first})") from None


URL_LIKE = re.compile(r"^https?://", re.I)
COMPRESSED = (".gz", ".zst", ".bz2")


def sample_key(url: str, caption: str) -> str:
    return "u" + hashlib.sha1(f"{url}\0{caption}".encode()).hexdigest()[:16]


# every format a list is read in, text ones also compressed as pyarrow decompresses them by suffix
URL_SUFFIXES = (".parquet",) + tuple(f"{base}{c}" for base in (".csv", ".tsv", ".jsonl", ".json")
                                      for c in ("",) + COMPRESSED)


def partition_files(cfg: SourceConfig) -> list[Path]:
    """The URL list's files: `path` itself, or the list files in the folder, in name order. A file in
    the folder that is none of them is named, not skipped in silence (hidden files aside)."""
    path = Path(cfg.path)
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        files = [p for p in found if p.name.lower().endswith(URL_SUFFIXES)]
        others = [p.name for p in found if p not in files]
        if others:
            raise UserError(f"source.path {path}: {', '.join(others[:3])}{' ...' if len(others) > 3 else ''} "
                            f"{'is' if len(others) == 1 else 'are'} not a URL list capline reads (a folder holds "
                            f"only lists: .parquet, or .csv/.tsv/.jsonl/.json, plain or {'/'.join(COMPRESSED)}); "
                            "move it out, or name one file in source.path")
        if not files:
            raise UserError(f"source.path {path}: a folder without URL list files ({', '.join(URL_SUFFIXES)})")
        return files
    if not path.is_file():
        raise UserError(f"source.path {path}: no such file")
    return [path]


def require_columns(cfg: SourceConfig, wanted: dict[str, str]) -> None:
    """Every list file has each column a setting names (setting -> column), before anything downloads;
    else a one-line error naming the setting, the file and the closest names."""
    import difflib

    for f in partition_files(cfg):
        names = _read_columns(f, cfg.format, cfg.header, cfg.columns)
        for setting, col in wanted.items():
            if col not in names:
                close = difflib.get_close_matches(col, names, n=3, cutoff=0.5)
                raise UserError(f"{setting}: {f.name} has no column {col!r}"
                                + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else
                                   f" (its columns: {', '.join(names[:20])})"))


def check_url_list(cfg: SourceConfig) -> None:
    """Check a `kind: urls` list's files and columns; UserError names what is wrong."""
    require_columns(cfg, {f"source.where.{col}": col for col in cfg.where})
    for f in partition_files(cfg):
        names = _read_columns(f, cfg.format, cfg.header, cfg.columns)
        wanted = [column_ref(c, names, w) for c, w in ((cfg.url_col, "url_col"), (cfg.caption_col, "caption_col"),
                                                      (cfg.key_col, "key_col")) if c is not None]
        missing = [c for c in wanted if c not in names]
        if missing:
            hint = (" (a file without a header: set source.header: false and name columns by position, "
                    "e.g. source.url_col: 1)" if cfg.header and any(URL_LIKE.match(n) for n in names) else "")
            raise UserError(f"source.path {f}: missing column(s) {', '.join(missing)}; the file has "
                            f"{', '.join(names[:20]) or 'no columns'} (set source.url_col / caption_col){hint}")


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:60]


INVALID = object()     # a value whose bytes are not UTF-8
# a key becomes the tar member name `<key>.<ext>` (ustar: 100 bytes) and a file name in every tool
KEY_RE = re.compile(r"[A-Za-z0-9_\-+=,@~]{1,90}")


def texts(column: pa.ChunkedArray) -> list:
    """A text column's values, each str, None (missing: null or NaN) or INVALID (not UTF-8). Decoded
    row by row: one bad byte costs its row, not the file, and never becomes a "b'...'" caption."""
    t = column.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        column = column.cast(pa.large_binary() if pa.types.is_large_string(t) else pa.binary())
        t = column.type
    out = []
    for v in column.to_pylist():
        if v is None or (isinstance(v, float) and math.isnan(v)):
            out.append(None)
        elif isinstance(v, bytes):
            try:
                out.append(v.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(INVALID)
        else:
            out.append(str(v))
    return out


def _outside(value, bounds: dict) -> str | None:
    """Why `value` fails `bounds` ({min, max}, inclusive), or None if it is inside."""
    if isinstance(value, (bytes, str)):
        try:
            value = float(value)
        except ValueError:
            return f"is {value!r}, not a number"
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return "has no value"
    if "min" in bounds and value < bounds["min"]:
        return f"{value:g} < min {bounds['min']:g}"
    if "max" in bounds and value > bounds["max"]:
        return f"{value:g} > max {bounds['max']:g}"
    return None


def _ids(column: pa.ChunkedArray) -> list:
    """The list's own ids as text, as a person writes them: an id column that pandas or a writer made
    float (1000056.0) keeps its integers (1000056), so `capline explain RUN 1000056` finds it."""
    if pa.types.is_floating(column.type):
        return [None if v is None or math.isnan(v) else str(int(v)) if float(v).is_integer() else str(v)
                for v in column.to_pylist()]
    return texts(column)


class KeyState:
    """What keying a file's rows must remember across its batches: how often each key was seen (a
    repeat gets `_1`, `_2`, ... in row order), the user's keys and where each was first, and how many
    rows came before."""

    def __init__(self):
        self.seen: dict[str, int] = {}
        self.first: dict[str, int] = {}
        self.rows = 0


def keyed_rows(table: pa.Table | None, cfg: SourceConfig, part: str, lines: list[int] | None = None,
               malformed: list[dict] = (), state: KeyState | None = None) -> pa.Table:
    """A URL list file's rows -> key, url, caption, partition, verdict, reason, detail (one per row
    and one per malformed line). `lines`: each row's line in the file (details name it).

    A row with no URL or with bytes that are not UTF-8, and a line that is not a row (`malformed`:
    too few or too many columns), are kept in the ledger as dropped with their reason
    (`malformed_row:*`) and line. With `key_col`, keys must be unique and usable as tar member names:
    the file is refused before anything downloads, naming the first offending rows."""
    state = state or KeyState()
    if table is None:       # only lines set aside (after a text list's last batch)
        table = pa.table({})
        urls = caps = []
        ids, notes, too_long = None, [], np.zeros(0, bool)
    else:
        url_col, caption_col, key_col = (column_ref(c, table.column_names, w) for c, w in (
            (cfg.url_col, "url_col"), (cfg.caption_col, "caption_col"), (cfg.key_col, "key_col")))
        for c in (url_col, caption_col, key_col):
            if c and c not in table.column_names:
                raise UserError(f"source partition {part}: missing column {c}")
        # a field over source.max_field_bytes: its row set aside, the field never decoded into text
        too_long = _too_long(table, cfg.max_field_bytes)
        if too_long.any():
            keep = pa.array(~too_long)
            table = pa.table({n: pc.if_else(keep, table.column(n), pa.scalar(None, table.column(n).type))
                              for n in table.column_names})
        urls = texts(table.column(url_col))
        caps = texts(table.column(caption_col))
        ids = _ids(table.column(key_col)) if key_col else None
        # the key column stays in the sample's JSON as the list wrote it (DataComp's uid): the key
        # itself is made safe for tar member names, and unique
        notes = _carried(table, cfg, part, {url_col, caption_col})
        if ids is not None:
            _check_keys(ids, key_col, part, state)
    seen = state.seen
    keys, out_urls, out_caps, verdicts, reasons, details = [], [], [], [], [], []
    for i, (url, cap) in enumerate(zip(urls, caps)):
        if too_long[i]:
            keys.append("m" + hashlib.sha1(f"{part}\0row\0{state.rows + i}".encode()).hexdigest()[:16])
            out_urls.append(None)
            out_caps.append("")
            verdicts.append(DROPPED)
            reasons.append("malformed_row:field_too_large")
            where = f"{part} line {lines[i]}" if lines is not None else f"{part} row {state.rows + i + 1}"
            details.append(f"{where}: a field longer than {cfg.max_field_bytes:,} bytes (source.max_field_bytes)")
            continue
        bad = "url" if url is INVALID else "caption" if cap is INVALID else None
        url = url.strip() if isinstance(url, str) else None
        cap = cap if isinstance(cap, str) else ""
        base = ids[i].replace(".", "_").replace("/", "_") if ids is not None else sample_key(str(url), cap)
        n = seen.get(base, 0)
        seen[base] = n + 1
        key = base if n == 0 else f"{base}_{n}"
        ok = bool(url) and bad is None
        keys.append(key)
        out_urls.append(url if ok else None)
        out_caps.append(cap)
        verdicts.append(KEPT if ok else DROPPED)
        reasons.append("" if ok else "malformed_row:invalid_utf8" if bad else "malformed_row:missing_url")
        where = f"{part} line {lines[i]}" if lines is not None else f"{part} row {state.rows + i + 1}"
        details.append(where + (f": its {bad} is not UTF-8" if bad else ""))
    state.rows += len(urls)
    for col, bounds in cfg.where.items() if len(urls) else ():   # the list's own thresholds, in the ledger like any other
        if col not in table.column_names:
            raise UserError(f"source.where.{col}: {part} has no column {col!r}")
        for i, v in enumerate(table.column(col).to_pylist()):
            if verdicts[i] != KEPT:
                continue
            why = _outside(v, bounds)
            if why:
                verdicts[i], reasons[i] = DROPPED, f"list_filter:{col}"
                details[i] = f"{details[i]}: {col} {why} (source.where)"
    for m in malformed:     # a line that is not a row: a sample of its own, dropped, so it is counted
        keys.append("m" + hashlib.sha1(f"{part}\0{m['line']}\0{m['text']}".encode()).hexdigest()[:16])
        out_urls.append(None)
        out_caps.append("")
        verdicts.append(DROPPED)
        reasons.append("malformed_row:columns")
        details.append(f"{part} line {m['line']}: {m['actual']} columns where {m['expected']} were expected "
                       f"({m['text'][:120]!r})")
        notes.append(None)
    text = lambda v: pa.array(v, pa.string())     # noqa: E731 - typed even when empty (batches concatenate)
    return pa.table({"key": text(keys), "url": text(out_urls), "caption": text(out_caps),
                     "partition": text([part] * len(keys)), "verdict": text(verdicts), "reason": text(reasons),
                     "detail": text(details), "notes": text(notes)})


def _too_long(table: pa.Table, limit: int) -> np.ndarray:
    """Rows with a text or binary field longer than `limit` bytes."""
    out = np.zeros(table.num_rows, bool)
    for col in table.columns:
        t = col.type
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
            lengths = pc.fill_null(pc.binary_length(col), 0).to_numpy(zero_copy_only=False)
            out |= lengths > limit
    return out


MAX_CARRIED_CHARS = 1000
MAX_CARRIED_COLUMNS = 64
# what the stages call their scores and details in a sample's JSON (their `notes`; the registry
# imports this module, so the names are listed here, and tests/stages/test_url_lists.py checks them
# against the registry's)
STAGE_NOTES = frozenset({"basic_score", "basic_detail", "clip_score", "clip_score_detail", "dedup_score",
                         "dedup_detail", "eval_score", "eval_detail", "language", "language_score", "shard_score",
                         "shard_detail", "source_score", "source_detail", "tokenizer_score", "tokenizer_detail",
                         "train_score", "train_detail"})


SAMPLE_FIELDS = {"key", "url", "caption", "status", "error_message", "width", "height", "original_width",
                 "original_height", "sha256"}


def _jsonable(v):
    """A list cell as JSON: nested lists and structs as JSON arrays and objects (DataComp's
    face_bboxes stays a list of boxes, not its string), anything else unknown as its string."""
    import math

    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


def _carried(table: pa.Table, cfg: SourceConfig, part: str, used: set) -> list[str | None]:
    """Each row's other columns (source.keep_columns) as the JSON its sample carries to the shards."""
    names = table.column_names
    if cfg.keep_columns is None:
        wanted = [n for n in names if n not in used] if part.endswith(".parquet") else []
    else:
        wanted = [column_ref(c, names, "keep_columns") for c in cfg.keep_columns]
        missing = [c for c in wanted if c not in names]
        if missing:
            raise UserError(f"source.keep_columns: {part} has no column(s) {', '.join(missing)} "
                            f"(columns: {', '.join(names[:20])})")
    if not wanted:
        return [None] * table.num_rows
    if len(wanted) > MAX_CARRIED_COLUMNS:
        raise UserError(f"source.keep_columns: {part} would carry {len(wanted)} columns into every sample (at most "
                        f"{MAX_CARRIED_COLUMNS}); name the ones to keep in source.keep_columns")
    # a list's own column named like a field capline writes (DataComp's sha256, a width, a stage's
    # score: clip_score, language) keeps its value under source_<name>, never posing as capline's
    reserved = SAMPLE_FIELDS | STAGE_NOTES
    cols = {(f"source_{n}" if n in reserved else n): table.column(n).to_pylist() for n in wanted}
    out = []
    for i in range(table.num_rows):
        entry, size, left = {}, 2, 0
        for n, values in cols.items():
            v = _jsonable(values[i])
            if v is None:
                continue
            cost = len(json.dumps({n: v}, ensure_ascii=False).encode()) - 1
            if len(json.dumps(v)) > MAX_CARRIED_CHARS or size + cost > cfg.carried_bytes:
                left += 1          # over a value's or the sample's cap: left out, and said so
                continue
            entry[n], size = v, size + cost
        if left:
            entry["source_left_out"] = left
        out.append(json.dumps(entry, sort_keys=True, ensure_ascii=False) if entry else None)
    return out


def _check_keys(ids: list, column: str, part: str, state: KeyState | None = None) -> None:
    state = state or KeyState()
    first = state.first
    dup, bad = [], []
    for j, k in enumerate(ids):
        i = state.rows + j
        if not isinstance(k, str) or not KEY_RE.fullmatch(k.replace(".", "_").replace("/", "_")):
            bad.append((i, k))
            continue
        k = k.replace(".", "_").replace("/", "_")
        if k in first:
            dup.append((first[k], i, k))
        else:
            first[k] = i
    if bad:
        shown = ", ".join(f"row {i} ({_show(v)})" for i, v in bad[:5])
        raise UserError(f"source partition {part}: {len(bad)} {column} value(s) cannot be sample keys "
                        f"(1-90 characters of A-Z a-z 0-9 _ - + = , @ ~; they name tar members): {shown}")
    if dup:
        shown = ", ".join(f"rows {a} and {b} ({k!r})" for a, b, k in dup[:5])
        raise UserError(f"source partition {part}: {len(dup)} duplicate {column} value(s): {shown}; "
                        "keys must be unique (drop key_col to let capline key rows by URL and caption)")


def _show(v) -> str:
    if v is INVALID:
        return "not UTF-8"
    if v is None:
        return "missing"
    return repr(v[:40] + ("..." if len(v) > 40 else ""))


class PartitionWriter:
    """A file's keyed rows, written as partitions `<name>-NNNNN` of `rows_per_part` as they come:
    what a task holds is one partition's rows, whatever the file's size. `folder`: where their
    ledgers go (default: the stage's ledger folder)."""

    def __init__(self, storage, name: str, rows_per_part: int, folder: str | None = None, own_keys: bool = False):
        self.storage, self.name, self.per, self.folder, self.own_keys = storage, name, rows_per_part, folder, own_keys
        self.pending: list[pa.Table] = []
        self.held = 0
        self.out: list[PartResult] = []
        self.hashes: list[np.ndarray] = []     # with a folder: each partition's base hashes (keys.base_hashes)

    def add(self, rows: pa.Table) -> None:
        self.pending.append(rows)
        self.held += rows.num_rows
        while self.held >= self.per:
            self._write(self.per)

    def _write(self, n: int) -> None:
        t = pa.concat_tables(self.pending) if self.pending else None
        chunk, rest = (t.slice(0, n), t.slice(n)) if t is not None else (None, None)
        self.pending, self.held = ([rest] if rest is not None and rest.num_rows else []), max(0, self.held - n)
        part = f"{safe_name(self.name)}-{len(self.out):05d}"
        if chunk is None:   # an empty file: one empty partition, of the rows' columns
            chunk = pa.table({c: pa.array([], pa.string()) for c in
                              ("key", "url", "caption", "partition", "verdict", "reason", "detail", "notes")})
        keys = chunk.column("key").to_pylist()
        if self.folder:     # a list file keyed for the check across files (not a generated source)
            self.hashes.append(base_hashes(keys, self.own_keys))
        self.out.append(write_part(self.storage, "source", part, None, keys, chunk,
                                   rel=f"{self.folder}/{part}.parquet" if self.folder else None))

    def close(self) -> list[PartResult]:
        if self.held or not self.out:      # the rest, or an empty file's one empty partition
            self._write(self.held)
        return self.out

    def bases(self) -> pa.Table:
        """The file's key bases as hashes, with the partition (its index in the file) of each."""
        return bases_table(self.hashes)


def write_partitions(storage, rows: pa.Table, name: str, rows_per_part: int) -> list[PartResult]:
    """Split one source file's keyed rows into partitions `<name>-NNNNN` and write them."""
    out = PartitionWriter(storage, name, rows_per_part)
    out.add(rows)
    return out.close()


def _read_file_task(storage, path: str, cfg: SourceConfig, pinned: str | None = None,
                    folder: str | None = None) -> list[PartResult]:
    """Ray task: read one URL list file, key its rows, write its partitions. `pinned`: the file's copy
    in the run folder's storage, for a worker that cannot see the driver's disk. `folder`: where
    the partitions go, with the record that lets a later run take them as they are (`folder.json`,
    written last: a record found means whole partitions)."""
    import tempfile

    name = Path(path).name
    with tempfile.TemporaryDirectory(prefix="capline-source-") as tmp:
        local = Path(path)
        if pinned is not None:
            local = Path(tmp) / name
            storage.download(pinned, local)
        state, out = KeyState(), PartitionWriter(storage, name, cfg.rows_per_part, folder, own_keys=bool(cfg.key_col))
        for table, lines, malformed in iter_list(local, cfg.format, _text_cols(cfg, local), cfg.header, cfg.columns,
                                                 cfg.max_field_bytes, cfg.max_list_bytes):
            out.add(keyed_rows(table, cfg, name, lines, malformed, state))
        parts = out.close()
        if folder:
            # what the check across files reads of this file from now on: 12 bytes a row, not its keys
            storage.write_table(f"{folder}/{BASES}", out.bases())
            storage.write_json(f"{folder}.json", {"parts": [p.to_json() for p in parts]})
        return parts


KEYED = "source/keyed"     # each list file's keyed partitions, by its content and the keying config (preserved)


# every keyed file's record, in the records' one summary table (stages/records.py), read in one request
RECORDS = records.summary_path(KEYED)


def keyed_folder(f: Path, sha: str, cfg: SourceConfig) -> str:
    """Where a list file's partitions are kept: by its content, its name (the partitions' names come
    from it) and the settings that key and filter rows (not the list's path)."""
    import dataclasses

    how = hashlib.sha256(json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k != "path"},
                                    sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{KEYED}/{safe_name(f.name)}-{sha[:16]}-{how}"


_SHA_MEMO: dict[tuple, str] = {}


def list_sha256(f: Path) -> str:
    """A list file's sha256, computed once per process while its size and mtime stay (the stage's
    fingerprint, the pinned copy and the keyed partitions all name the file by it)."""
    st = f.stat()
    memo = (str(f.resolve()), st.st_size, st.st_mtime_ns)
    if memo not in _SHA_MEMO:
        _SHA_MEMO[memo] = file_sha256(f)
    return _SHA_MEMO[memo]


def _text_cols(cfg: SourceConfig, path: Path) -> tuple:
    if _format(path, cfg.format) not in ("csv", "tsv"):
        return ()
    names = _read_columns(path, cfg.format, cfg.header, cfg.columns)
    return tuple(column_ref(c, names, w) for c, w in ((cfg.url_col, "url_col"), (cfg.caption_col, "caption_col"),
                                                    (cfg.key_col, "key_col")) if c is not None)


INPUT = "source/input"     # the list files pinned in an object-store run folder, by content (preserved)


def pin_inputs(storage, files: list[Path]) -> list[str | None]:
    """Each list file's copy in the run folder's storage, by content (Storage.pin_copies)."""
    return storage.pin_copies(INPUT, files, [list_sha256(f) for f in files])


class SourceStage(Source):
    name = "source"
    preserve = ("input", "keyed")
    reasons = ("malformed_row", "missing_url", "invalid_url", "duplicate_key", "list_filter")

    def section(self, config) -> SourceConfig:
        return config.source

    def preflight(self, config) -> None:
        if config.source.kind == "urls":
            check_url_list(config.source)
        if config.source.kind == "openclipart":
            openclipart.svg_root(config.source.path)

    def input_fingerprint(self, config) -> dict:
        """The source as a scheduled run compares it (for a URL folder: each file's name and sha256)."""
        cfg = config.source
        if cfg.kind == "urls":
            return {"kind": "urls", "path": str(cfg.path),
                    "files": {f.name: list_sha256(f) for f in partition_files(cfg)}}
        if cfg.kind == "openclipart":
            root = openclipart.svg_root(cfg.path)
            files = openclipart.list_svgs(root)
            return {"kind": "openclipart", "path": str(root), "files": {"count": len(files)},
                    "digest": openclipart.tree_digest(root, files), "limit": cfg.limit}
        return {"kind": cfg.kind, "seed": config.seed, "num_samples": cfg.num_samples}

    # what the synthetic source writes besides its URL list: 2 = its held-out split also as COCO
    # captions and word-order pairs (an older run's source is regenerated, not reused without them)
    HELDOUT_FORMAT = 2

    def fingerprint(self, config) -> str:
        extra = {"heldout_format": self.HELDOUT_FORMAT} if config.source.kind == "synthetic" else {}
        return super().fingerprint(config) + json.dumps({**self.input_fingerprint(config), **extra}, sort_keys=True)

    def declares(self, cfg: SourceConfig) -> dict:
        """What ingest needs of a source this run serves itself (the demo's site), so ingest never
        reads the source's config section."""
        return {"site": {"served": cfg.served, "folder": "source/www", "slow_seconds": cfg.slow_seconds,
                         "port": cfg.serve_port}}

    def run(self, ctx: StageContext) -> StageResult:
        cfg: SourceConfig = ctx.cfg
        if cfg.kind == "synthetic":
            counts = synthetic.generate(ctx.stage_dir, cfg.num_samples, cfg.eval_size, cfg.image_size,
                                        ctx.seed, vars(cfg.defects), cfg.huge_pixels, cfg.huge_bytes)
            ctx.log(f"source: generated {cfg.num_samples} demo samples, "
                    f"{sum(v for k, v in counts.items() if k != 'clean')} with planted defects")
            return self._generated(ctx, cfg, pq.read_table(ctx.stage_dir / "urls.parquet"), "demo",
                                   {"planted": counts})
        if cfg.kind == "openclipart":
            return self._openclipart(ctx, cfg)
        files = partition_files(cfg)
        # a run folder in object storage means nodes that share no disk: the list travels through it,
        # each file once: named by its content, a file an earlier run pinned is not uploaded again
        pinned = pin_inputs(ctx.storage, files)
        # a file keyed before, with the same content and settings, is taken as it is: its record comes
        # from the records' summary the last run wrote (one read), or from its own file (a keying task
        # writes it last) where the summary lacks it (records.find): an append keys only what it added
        folders = [keyed_folder(f, list_sha256(f), cfg) for f in files]
        summary = records.read_summary(ctx.storage, KEYED)
        found = records.find(ctx.storage, {d: f"{d}.json" for d in folders}, {KEYED: summary})
        keyed = [found.get(d) for d in folders]
        todo = [i for i, r in enumerate(keyed) if not (isinstance(r, dict) and isinstance(r.get("parts"), list))]
        if len(todo) < len(files):
            ctx.log(f"source: {len(files) - len(todo)} URL list file(s) keyed before with the same content, reused; "
                    f"{len(todo)} to read")
        ran = ctx.run(_read_file_task, [(ctx.storage, str(files[i]), cfg, pinned[i], folders[i]) for i in todo],
                      "source", num_cpus=1, describe=lambda c: f"URL list file {Path(c[1]).name}", unit="files")
        results = [[PartResult.from_json(p) for p in r["parts"]] if i not in todo else None
                   for i, r in enumerate(keyed)]
        for i, r in zip(todo, ran):
            results[i] = r
        if set(summary) != {f"{d}.json" for d in folders} or todo:   # before the deletes: it never names a deleted folder
            records.write_summary(ctx.storage, KEYED, {f"{d}.json": {"parts": [p.to_json() for p in r]}
                                                       for d, r in zip(folders, results)})
        keep = {d.rsplit("/", 1)[-1] for d in folders}
        stale = [d for d in ctx.storage.list_dirs(KEYED) if d not in keep]
        ctx.storage.delete_all([f"{KEYED}/{d}" for d in stale] + [f"{KEYED}/{d}.json" for d in stale])
        parts, renamed = unique_across_files(ctx, results, [f"{d}/{BASES}" for d in folders], bool(cfg.key_col), CHECKED)
        rows = sum(p.n_in for p in parts)
        ctx.log(f"source: {rows} rows from {cfg.path} in {len(files)} file(s), {len(parts)} partitions"
                + (f"; {renamed} rows repeat a row of an earlier file (kept under their own keys, for dedup "
                   "to drop as exact_duplicate)" if renamed else ""))
        return StageResult(parts, {"rows": rows, "files": len(files), "repeated_across_files": renamed})

    def _generated(self, ctx: StageContext, cfg: SourceConfig, table: pa.Table, name: str, extra: dict) -> StageResult:
        n = table.num_rows
        rows = table.append_column("verdict", pa.array([KEPT] * n, pa.string())).append_column(
            "reason", pa.array([""] * n, pa.string()))
        return StageResult(write_partitions(ctx.storage, rows, name, cfg.rows_per_part), extra)

    def _openclipart(self, ctx: StageContext, cfg: SourceConfig) -> StageResult:
        from infra.hashing import order_key

        root = openclipart.svg_root(cfg.path)
        files = openclipart.list_svgs(root)
        if cfg.limit:
            files = sorted(sorted(files, key=lambda f: order_key(ctx.seed, f))[: cfg.limit])
        ctx.log(f"source: rendering {len(files)} openclipart SVGs from {root} at {cfg.render_size} px")
        rows = openclipart.build(root, files, ctx.stage_dir / "www" / "img", cfg.render_size, ctx.run)
        ok = [not r["reason"] for r in rows]
        table = pa.table({
            "key": [r["key"] for r in rows],
            "url": [f"{synthetic.SERVER_PLACEHOLDER}/img/{r['file']}" if good else None for r, good in zip(rows, ok)],
            "caption": [r["caption"] if good else "" for r, good in zip(rows, ok)],
            "partition": ["openclipart"] * len(rows),
            "verdict": [KEPT if good else DROPPED for good in ok],
            "reason": [r["reason"] or "" for r in rows],
            "detail": [r["relpath"] if good else f"{r['relpath']}: {r['detail']}" for r, good in zip(rows, ok)],
        })
        parts = write_partitions(ctx.storage, table, "openclipart", cfg.rows_per_part)
        return StageResult(parts, {"svg_root": str(root), "svgs": len(files), "rendered": sum(ok)})
