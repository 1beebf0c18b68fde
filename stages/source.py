"""The source stage: turn the configured source into one URL list, `source/urls.parquet`.

- `kind: synthetic` generates the demo's captioned scenes (stages/synthetic.py), served later over
  loopback by the ingest stage.
- `kind: openclipart` renders Debian's openclipart-svg drawings, captioned by their titles and
  keywords (stages/openclipart.py), served like the demo over loopback; `limit` takes a seeded subset.
- `kind: urls` reads a user's URL list (Parquet, CSV, TSV or JSON lines) with `url_col` and
  `caption_col`, as CC3M / CC12M / DataComp / LAION metadata come. `path` may be one file or a
  folder of partition files (read in name order; a new file is a new partition, see ingest).
  Rows without a usable URL are dropped here with a reason; a file that cannot be read, or lacks a
  named column, is an error.

Every sample gets a stable key (no dots: WebDataset splits on them): `key_col` if given, else a
hash of URL and caption (a repeat of the same pair gets a `_N` suffix).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from trainers.configtools import join, require
from trainers.errors import UserError

from . import openclipart, synthetic
from .base import Ledger, Stage, StageContext, StageResult


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

    def validate(self, prefix: str) -> None:
        total = 0.0
        for name, value in vars(self).items():
            require(value >= 0, join(prefix, name), f"must be >= 0, got {value}")
            total += value if value < 1 else 0
        require(total < 0.9, prefix, f"fractions add up to {total:.2f}; keep them under 0.9")


@dataclass
class SourceConfig:
    kind: Literal["synthetic", "urls", "openclipart"] = "synthetic"
    # kind: urls (the list) or openclipart (the SVG folder; default /usr/share/openclipart/svg)
    path: str | None = None
    format: Literal["auto", "parquet", "csv", "tsv", "jsonl"] = "auto"
    url_col: str = "url"
    caption_col: str = "caption"
    key_col: str | None = None
    # kind: synthetic
    num_samples: int = 2000
    eval_size: int = 300
    image_size: int = 96
    slow_seconds: float = 6.0
    huge_pixels: int = 16000
    huge_bytes: int = 3_000_000
    defects: DefectFractions = field(default_factory=DefectFractions)
    # kind: openclipart
    limit: int | None = None         # a seeded subset of this many drawings (null: all 8,121)
    render_size: int = 128           # longest side of the rendered PNG

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


def _read_table(path: Path, fmt: str) -> pa.Table:
    if fmt == "auto":
        suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
        fmt = {".parquet": "parquet", ".csv": "csv", ".csv.gz": "csv", ".tsv": "tsv", ".tsv.gz": "tsv",
               ".jsonl": "jsonl", ".json": "jsonl"}.get(suffix.lower(), "")
        if not fmt:
            raise UserError(f"source.path {path}: cannot tell the format from '{suffix}'; "
                            "set source.format to parquet, csv, tsv or jsonl")
    try:
        if fmt == "parquet":
            return pq.read_table(path)
        if fmt == "csv":
            return pacsv.read_csv(path)
        if fmt == "tsv":
            return pacsv.read_csv(path, parse_options=pacsv.ParseOptions(delimiter="\t"))
        return pajson.read_json(path)
    except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"source.path {path}: not a readable {fmt} URL list ({first})") from None


def sample_key(url: str, caption: str) -> str:
    return "u" + hashlib.sha1(f"{url}\0{caption}".encode()).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


URL_SUFFIXES = (".parquet", ".csv", ".tsv", ".jsonl", ".json", ".csv.gz", ".tsv.gz")


def partition_files(cfg: SourceConfig) -> list[Path]:
    """The URL list's files: `path` itself, or the list files in the folder, in name order."""
    path = Path(cfg.path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.lower().endswith(URL_SUFFIXES))
        if not files:
            raise UserError(f"source.path {path}: a folder without URL list files ({', '.join(URL_SUFFIXES)})")
        return files
    if not path.is_file():
        raise UserError(f"source.path {path}: no such file")
    return [path]


def check_url_list(cfg: SourceConfig) -> list[tuple[str, pa.Table]]:
    """Read and check a `kind: urls` list; -> [(partition name, table)]; UserError names what is wrong."""
    return [(f.name, _check_file(f, cfg)) for f in partition_files(cfg)]


def _check_file(path: Path, cfg: SourceConfig) -> pa.Table:
    table = _read_table(path, cfg.format)
    wanted = [c for c in (cfg.url_col, cfg.caption_col, cfg.key_col) if c]
    missing = [c for c in wanted if c not in table.column_names]
    if missing:
        raise UserError(f"source.path {path}: missing column(s) {', '.join(missing)}; the file has "
                        f"{', '.join(table.column_names) or 'no columns'} (set source.url_col / caption_col)")
    return table


class SourceStage(Stage):
    name = "source"

    def section(self, config) -> SourceConfig:
        return config.source

    def fingerprint(self, config) -> str:
        base = super().fingerprint(config)
        if config.source.kind == "urls":
            return base + "".join(f.name + file_sha256(f) for f in partition_files(config.source))
        if config.source.kind == "openclipart":
            root = openclipart.svg_root(config.source.path)
            return base + openclipart.tree_digest(root, openclipart.list_svgs(root))
        return base

    def run(self, ctx: StageContext) -> StageResult:
        cfg: SourceConfig = ctx.config.source
        ledger = Ledger(self.name)
        out = ctx.stage_dir / "urls.parquet"
        if cfg.kind == "synthetic":
            counts = synthetic.generate(ctx.stage_dir, cfg.num_samples, cfg.eval_size, cfg.image_size,
                                        ctx.config.seed, vars(cfg.defects), cfg.huge_pixels, cfg.huge_bytes)
            ctx.log(f"source: generated {cfg.num_samples} demo samples, "
                    f"{sum(v for k, v in counts.items() if k != 'clean')} with planted defects")
            for key in pq.read_table(out, columns=["key"]).column("key").to_pylist():
                ledger.keep(key)
            return StageResult(ledger, {"planted": counts})
        if cfg.kind == "openclipart":
            return self._openclipart(ctx, cfg, ledger)

        keys, kept_urls, kept_caps, parts = [], [], [], []
        seen: dict[str, int] = {}
        rows = 0
        for part, table in check_url_list(cfg):
            urls = table.column(cfg.url_col).to_pylist()
            caps = table.column(cfg.caption_col).to_pylist()
            ids = table.column(cfg.key_col).to_pylist() if cfg.key_col else None
            for i, (url, cap) in enumerate(zip(urls, caps)):
                url = url.strip() if isinstance(url, str) else url
                cap = "" if cap is None else str(cap)
                if ids is not None:
                    base = str(ids[i]).replace(".", "_").replace("/", "_")
                else:
                    base = sample_key(str(url), cap)
                n = seen.get(base, 0)
                seen[base] = n + 1
                key = base if n == 0 else f"{base}_{n}"
                if not isinstance(url, str) or not url:
                    ledger.drop(key, "malformed_row:missing_url", detail=f"{part} row {i}")
                    continue
                ledger.keep(key, detail=f"{part} row {i}")
                keys.append(key)
                kept_urls.append(url)
                kept_caps.append(cap)
                parts.append(part)
            rows += len(urls)
        pq.write_table(pa.table({"key": keys, "url": kept_urls, "caption": kept_caps, "partition": parts}), out)
        ctx.log(f"source: {rows} rows from {cfg.path}, {len(keys)} with a URL")
        return StageResult(ledger, {"rows": rows})

    def _openclipart(self, ctx: StageContext, cfg: SourceConfig, ledger: Ledger) -> StageResult:
        from .tokenizer import order_key

        root = openclipart.svg_root(cfg.path)
        files = openclipart.list_svgs(root)
        if cfg.limit:
            files = sorted(sorted(files, key=lambda f: order_key(ctx.config.seed, f))[: cfg.limit])
        ctx.log(f"source: rendering {len(files)} openclipart SVGs from {root} at {cfg.render_size} px")
        rows = openclipart.build(root, files, ctx.stage_dir / "www" / "img", cfg.render_size, log=ctx.log)
        keys, urls, caps = [], [], []
        for r in rows:
            if r["reason"]:
                ledger.drop(r["key"], r["reason"], detail=f"{r['relpath']}: {r['detail']}")
                continue
            ledger.keep(r["key"], detail=r["relpath"])
            keys.append(r["key"])
            urls.append(f"{synthetic.SERVER_PLACEHOLDER}/img/{r['file']}")
            caps.append(r["caption"])
        pq.write_table(pa.table({"key": keys, "url": urls, "caption": caps, "partition": ["openclipart"] * len(keys)}),
                       ctx.stage_dir / "urls.parquet")
        return StageResult(ledger, {"svg_root": str(root), "svgs": len(files), "rendered": len(keys)})
