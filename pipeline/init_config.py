"""`capline init FILE`: look at a URL list, find its URL and caption columns, write a config for it.

Reads the first rows only (a Parquet file's first row group, a text file's first 4 MB). The URL
column is the one whose values are mostly http(s) URLs; the caption column the text column, other
than that, with the most words per value, a column named like a caption (caption, text, alt, title,
description) winning ties. A key column (key, uid, id) is used if its values are unique. The config
written is the demo's pipeline with `source.kind: urls`; every other value is a default to edit.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa

from infra.errors import UserError

CAPTION_NAMES = ("caption", "text", "alt", "alt_text", "title", "description", "txt")
KEY_NAMES = ("key", "uid", "id", "sample_id")
SIMILARITY_NAMES = ("similarity", "clip_score", "clip_similarity")   # an image-text score a list may carry
# DataComp's pool metadata: OpenAI CLIP L/14's and B/32's cosines; its best baseline cuts L/14's at
# the top 30 % of the pool ("CLIP score (L/14 30%)"), so that is what init writes, L/14 first
DATACOMP_SCORES = ("clip_l14_similarity_score", "clip_b32_similarity_score")
URL_RE = re.compile(r"^https?://\S+$", re.I)


def _head(path: Path, fmt: str) -> pa.Table:
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    from stages.source.stage import _format

    fmt = _format(path, fmt)
    try:
        if fmt == "parquet":
            f = pq.ParquetFile(path)
            return f.read_row_group(0) if f.num_row_groups else f.schema_arrow.empty_table()
        with pa.input_stream(str(path), compression="detect") as f:   # .gz / .zst / .bz2 by suffix
            data = f.read(4 << 20)
        data = data[: data.rfind(b"\n") + 1] or data
        if fmt in ("csv", "tsv"):
            malformed: list[tuple[int, str]] = []

            def set_aside(row) -> str:      # counted, with its line: the run drops it as malformed_row:columns
                malformed.append((row.number, (row.text or "")[:80]))
                return "skip"

            parse = pacsv.ParseOptions(delimiter="\t" if fmt == "tsv" else ",", invalid_row_handler=set_aside)
            t = pacsv.read_csv(pa.BufferReader(data), parse_options=parse, read_options=pacsv.ReadOptions(use_threads=False))
            meta = {}
            if any(URL_RE.match(n.strip()) for n in t.column_names):
                # a URL among the "column names": the first line is a row (CC3M's TSVs have no header)
                malformed.clear()
                t = pacsv.read_csv(pa.BufferReader(data), parse_options=parse,
                                   read_options=pacsv.ReadOptions(autogenerate_column_names=True, use_threads=False))
                t = t.rename_columns([str(i) for i in range(t.num_columns)])
                meta[b"capline_headerless"] = b"1"
            meta[b"capline_malformed"] = json.dumps(malformed).encode()
            return t.replace_schema_metadata(meta)
        return pajson.read_json(pa.BufferReader(data))
    except (pa.ArrowInvalid, OSError) as err:
        raise UserError(f"{path}: not a readable {fmt} file ({str(err).splitlines()[0]})") from None


def _strings(col: pa.ChunkedArray) -> list[str]:
    out = []
    for v in col.slice(0, 2000).to_pylist():
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        if isinstance(v, str):
            out.append(v)
    return out


def detect(path: Path, fmt: str = "auto") -> dict:
    """-> {format, url_col, caption_col, key_col, rows_seen}; a UserError naming the columns if none fits."""
    from stages.source.stage import _format

    t = _head(path, fmt)
    if t.num_rows == 0:
        raise UserError(f"{path}: no rows to look at")
    scores = {}
    for name in t.column_names:
        vals = _strings(t.column(name))
        if not vals:
            continue
        urls = sum(bool(URL_RE.match(v.strip())) for v in vals) / len(vals)
        words = sum(len(v.split()) for v in vals) / len(vals)
        scores[name] = (urls, words)
    url_col = max((n for n in scores if scores[n][0] >= 0.5), key=lambda n: scores[n][0], default=None)
    if url_col is None:
        raise UserError(f"{path}: no column holds mostly http(s) URLs (columns: {', '.join(t.column_names)}); "
                        "write the config by hand with source.url_col")
    texts = [n for n in scores if n != url_col and scores[n][0] < 0.5]
    caption_col = max(texts, key=lambda n: (scores[n][1] + (1.0 if n.lower() in CAPTION_NAMES else 0.0)), default=None)
    if caption_col is None:
        raise UserError(f"{path}: found URLs in '{url_col}' but no text column for captions "
                        f"(columns: {', '.join(t.column_names)})")
    key_col = None
    for name in t.column_names:
        if name.lower() in KEY_NAMES and name not in (url_col, caption_col):
            vals = [str(v) for v in t.column(name).slice(0, 2000).to_pylist()]
            if len(set(vals)) == len(vals):
                key_col = name
                break
    headerless = bool(t.schema.metadata and t.schema.metadata.get(b"capline_headerless"))
    if headerless:   # columns by position
        url_col, caption_col = int(url_col), int(caption_col)
        key_col = int(key_col) if key_col is not None else None
    malformed = json.loads((t.schema.metadata or {}).get(b"capline_malformed", b"[]"))
    urls = _strings(t.column(url_col if not headerless else str(url_col)))
    lowered = {n.lower(): n for n in t.column_names}
    datacomp = next((lowered[n] for n in DATACOMP_SCORES if n in lowered), None)
    similarity = datacomp or next((n for n in t.column_names if n.lower() in SIMILARITY_NAMES), None)
    return {"format": _format(path, fmt), "url_col": url_col, "caption_col": caption_col, "key_col": key_col,
            "malformed": malformed, "similarity_col": similarity, "datacomp": datacomp is not None,
            "private_hosts": private_hosts(urls),
            "header": not headerless, "rows_seen": t.num_rows, "url_share": scores[url_col if not headerless else str(url_col)][0],
            "caption_words": scores[caption_col if not headerless else str(caption_col)][1]}


def check_hosts(cfg) -> list[str]:
    """`capline check`'s dry read of a URL list: the first rows of each file, their hosts against
    stages.ingest.allow_hosts. A list whose every URL looked at is on a private or loopback host
    ingest would refuse is a UserError (the run would download nothing); -> notes: some such hosts,
    and allow_hosts entries no URL looked at names."""
    import urllib.parse

    from stages.source.stage import partition_files

    src = cfg.source
    if src.kind != "urls" or not src.path:
        return []
    urls: list[str] = []
    for f in partition_files(src):
        t = _head(f, src.format)
        col = str(src.url_col) if str(src.url_col) in t.column_names else None   # by position when headerless
        urls += _strings(t.column(col))[:500] if col else []
    if not urls:
        return []
    allowed = set(cfg.stages.ingest.allow_hosts or ())
    netlocs = {urllib.parse.urlsplit(u.strip()).netloc.rsplit("@", 1)[-1] for u in urls}
    refused = [h for h in private_hosts(urls) if h not in allowed and h.rsplit(":", 1)[0] not in allowed]
    notes = []
    if refused and set(refused) >= netlocs:
        raise UserError(f"source.path {src.path}: every URL of the {len(urls)} first rows names a private or loopback "
                        f"host ({', '.join(refused[:3])}), which ingest refuses: the run would download nothing; if "
                        f"you trust them, set stages.ingest.allow_hosts: {json.dumps(refused[:5])}")
    if refused:
        notes.append(f"{len(refused)} private or loopback host(s) among the first rows ({', '.join(refused[:3])}) are "
                     "refused by ingest unless stages.ingest.allow_hosts lists them")
    unused = sorted(a for a in allowed if a not in netlocs and not any(n.rsplit(":", 1)[0] == a for n in netlocs))
    if unused:
        notes.append(f"stages.ingest.allow_hosts entr{'y' if len(unused) == 1 else 'ies'} {', '.join(unused[:3])} "
                     f"match{'es' if len(unused) == 1 else ''} no URL of the first rows (host:port, as the URLs spell it)")
    return notes


def private_hosts(urls: list[str]) -> list[str]:
    """host:port of the URLs that name a private, loopback or link-local address (or localhost), which
    ingest refuses unless stages.ingest.allow_hosts lists them. Names are not looked up (init is offline)."""
    import ipaddress
    import urllib.parse

    found = set()
    for u in urls:
        parts = urllib.parse.urlsplit(u.strip())
        host = parts.hostname or ""
        try:
            private = not ipaddress.ip_address(host).is_global
        except ValueError:
            private = host == "localhost" or host.endswith((".localhost", ".local", ".internal"))
        if private:
            found.add(parts.netloc.rsplit("@", 1)[-1])
    return sorted(found)


def malformed_note(malformed: list) -> str:
    """One line about the lines of the list that are not rows (as init read them)."""
    shown = ", ".join(f"line {n}" for n, _ in malformed[:3])
    return (f"{len(malformed)} line(s) of those read are not rows of the list ({shown}"
            f"{', ...' if len(malformed) > 3 else ''}: too few or too many columns); the run drops each as "
            "malformed_row:columns, naming its line")


def write_config(path: Path, out: Path, found: dict, name: str | None = None) -> str:
    """A data-build config for the list (download, dedup, filters, tokenizer, shards; training and
    evaluation written out but commented), each value that is not a default with its reason."""
    import yaml

    # the whole file name (foo.tsv and foo.tsv.gz are two lists: two runs, two configs)
    name = name or re.sub(r"[^A-Za-z0-9_-]+", "-", path.name).strip("-") or "run"
    source = {"kind": "urls", "path": str(path.resolve()), "format": found["format"],
              "url_col": found["url_col"], "caption_col": found["caption_col"]}
    if found["key_col"] is not None:
        source["key_col"] = found["key_col"]
    if not found.get("header", True):
        source["header"] = False
    dump = lambda obj: yaml.safe_dump(obj, sort_keys=False, width=1000).rstrip("\n")   # noqa: E731
    indent = lambda text, n: "\n".join(" " * n + line for line in text.splitlines())   # noqa: E731
    if found.get("datacomp"):
        clip = (f"    clip_score:   # DataComp's CLIP score (L/14 30%) baseline: the top 30 % of the pool by the list's "
                f"'{found['similarity_col']}'\n"
                f"      {{scorer: column, column: {found['similarity_col']}, threshold: null, keep_fraction: 0.3, "
                "keep_fraction_of: pool}\n")
    elif found.get("similarity_col"):
        clip = (f"    clip_score:   # the list's own '{found['similarity_col']}' column is the score (LAION's cut): "
                "no scorer to train\n"
                f"      {{scorer: column, column: {found['similarity_col']}, threshold: 0.28, keep_fraction: null}}\n")
    else:
        clip = ("    clip_score:   # no score in the list: a small CLIP* is trained on it first, and the best 90 % kept\n"
                "      {scorer: bootstrap, keep_fraction: 0.9}\n")
    hosts = found.get("private_hosts") or []
    # never allowed for the user: a list naming internal addresses is how a crawl is turned on a network
    allow = (f"    # the list's URLs name private or loopback hosts, which ingest refuses; if you trust them:\n"
             f"    # ingest: {{allow_hosts: {json.dumps(hosts)}}}\n" if hosts else "")
    text = (
        f"# Written by `capline init {path}`: URLs in '{found['url_col']}' ({100 * found['url_share']:.0f}% of "
        f"{found['rows_seen']} rows looked at), captions in '{found['caption_col']}' "
        f"({found['caption_words']:.1f} words on average).\n"
        + (f"# {malformed_note(found['malformed'])}\n" if found.get("malformed") else "")
        + "# A data build: download, deduplicate, filter, tokenize, shard. `capline config` lists every other\n"
        "# setting with its default; `capline check " + str(out) + "` checks this file; run it with\n"
        "# `capline run " + str(out) + "`.\n"
        f"name: {json.dumps(name)}\n"
        "seed: 0\n"
        "source:\n" + indent(dump(source), 2) + "\n"
        "stages:\n"
        + allow +
        "    dedup:\n"
        "      # the evaluation sets your models will be tested on: no training image may be a copy of one\n"
        "      # (e.g. {name: imagenet_val, kind: folder, path: /data/imagenet/val}); none listed here\n"
        "      eval_sets: []\n"
        "    basic:   # DataComp's basic filter: images of 200 px or more, aspect up to 3, captions of 3 words or more\n"
        "      {min_image_side: 200, max_aspect_ratio: 3.0, min_words: 3}\n"
        "    language: {languages: [en]}   # English captions (the confidence cut is the measured default)\n"
        + clip +
        "train:\n"
        "  steps: 0   # no training: this config builds the dataset\n"
        "# To pretrain on the shards too (the paper's CapPa; `capline models` lists families and sizes):\n"
        "# train: {model: cappa, size: tiny, steps: 1000}\n"
        "# eval:  {fewshot: [{name: digits, kind: builtin, path: digits}]}\n")
    yaml.safe_load(text)     # what was written is valid YAML (and load_config checks it in the test)
    if out.exists():
        raise UserError(f"{out} exists; give another --output or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return name
