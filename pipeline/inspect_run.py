"""`capline status` and `capline explain`: read a run folder, print what happened."""
from __future__ import annotations

import pyarrow.parquet as pq

from infra.errors import UserError
from infra.storage import Storage

from stages.registry import STAGES

from .runner import stage_names

# Every tool here reads the run folder where it is (a local folder or a bucket, through Storage):
# status reads each stage's control files, explain a sample's rows; neither fetches the data.


def _require_run(storage: Storage) -> None:
    if not storage.exists("manifest.json"):
        raise UserError(f"{storage.uri()}: not a capline run folder (no manifest.json)")


def status_rows(where) -> list[dict]:
    """One row per stage, from its `_SUCCESS`, `_STARTED` and `stats.json` alone. A finished stage is
    `stale` when the stage before it is not finished, or finished since with another output than the
    one this stage was made from: a rerun redoes it."""
    storage = Storage.of(where)
    _require_run(storage)
    rows = []
    prev = judge = {"output_digest": ""}
    sinks: list = []         # the markers of the sinks since the last judge (None: one not done)
    for name, kind, reads_sinks in ((s.name, s.kind, s.reads_sinks_before) for s in STAGES):
        marker = storage.read_json(f"{name}/_SUCCESS")
        if marker:
            made_from, judged = marker.get("upstream_digest"), marker.get("judged_digest")
            have = {m.get("output_digest") for m in sinks if m is not None}
            before = prev if kind != "sink" or reads_sinks else judge    # what it read (runner.stage_inputs)
            upstream_ok = before is not None and (made_from is None or made_from == before.get("output_digest")) \
                and (judged is None or (judge is not None and judged == judge.get("output_digest"))) \
                and all(d in have for d in marker.get("sink_digests", []))
            state = "done" if upstream_ok else "stale"
        elif storage.exists(f"{name}/_STARTED"):
            state = "incomplete"
        elif name == "eval" and [f for f in storage.list("eval", ".json")
                                 if f.rsplit("/", 1)[-1] not in ("parts.json", "stats.json")]:
            state = "evaluated"     # by `capline eval` on a checkpoint, not by the run's eval stage
        else:
            state = "pending"
        stats = (storage.read_json(f"{name}/stats.json") or {}) if marker else {}
        kept = stats.get("kept")
        if name == "shard" and kept is not None:   # what removals took out of the line since the stage ran
            from stages.shard.line import read_line

            since = marker.get("completed_at", "")
            kept -= sum(int(r.get("removed") or 0) for r in (read_line(storage) or {}).get("removals") or []
                        if str(r.get("at", "")) >= since)
        rows.append({"stage": name, "state": state, "in": stats.get("in"), "kept": kept,
                     "dropped": stats.get("dropped", {}), "wall_seconds": stats.get("wall_seconds")})
        prev = marker if state == "done" else None
        if kind != "sink":
            judge, sinks = prev, []
        else:
            sinks.append(prev)
    return rows


def format_status(rows: list[dict]) -> str:
    head = ("stage", "state", "in", "kept", "dropped", "wall", "dropped by reason")
    body = []
    for r in rows:
        dropped = r["dropped"] or {}
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(dropped.items(), key=lambda kv: -kv[1]))
        body.append((r["stage"], r["state"], _n(r["in"]), _n(r["kept"]),
                     _n(sum(dropped.values()) if r["in"] is not None else None),
                     f"{r['wall_seconds']:.1f}s" if r["wall_seconds"] is not None else "-",
                     reasons or "-"))
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head) - 1)]
    lines = []
    for row in [head, *body]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return "\n".join(lines)


def _n(v) -> str:
    return "-" if v is None else str(v)


def key_of_url(where, url: str) -> str:
    """The key the source stage gave a URL (the first row, if the list holds it twice)."""
    from stages.base import has_ledger, read_ledger

    run_dir = Storage.of(where)
    _require_run(run_dir)
    if not has_ledger(run_dir, "source"):
        raise UserError(f"{run_dir.uri()}: the source stage has not run; no URL is known yet")
    for name in ("source", "ingest"):   # ingest's column is the URL fetched (a served demo's real address)
        if has_ledger(run_dir, name):
            rows = read_ledger(run_dir, name, ["key"], filters=[("url", "==", url)]).column("key").to_pylist()
            if rows:
                return rows[0]
    raise UserError(f"no sample with URL {url!r} in {run_dir.uri()}")


def explain(where, key: str) -> list[dict]:
    """The sample's row in every stage's ledger up to the one that dropped it; a kept sample's last
    row (shard) names its tar and the byte offset of its first member."""
    run_dir = Storage.of(where)
    _require_run(run_dir)
    out = []
    from stages.base import has_ledger, read_ledger

    from .key_index import lookup

    for name in stage_names():
        if not has_ledger(run_dir, name):
            continue
        file = lookup(run_dir, name, key)   # one small read; None: a run made before the indexes
        if file is None:
            rows = read_ledger(run_dir, name, filters=[("key", "==", key)]).to_pylist()
        else:
            rows = pq.read_table(run_dir.path(file), filesystem=run_dir.fs,
                                 filters=[("key", "==", key)]).to_pylist() if file else []
        if name == "source" and rows:
            out.append({"stage": "(input)", "verdict": "", "reason": "", "score": None,
                        "detail": f"url={rows[0]['url']} caption={rows[0]['caption']!r}",
                        "url": rows[0]["url"], "caption": rows[0]["caption"]})
        for r in rows:
            row = {c: r.get(c) for c in ("key", "stage", "verdict", "reason", "score", "detail")}
            row.update({c: r[c] for c in ("match_set", "match_key") if r.get(c)})   # what a match refers to
            if r.get("match_key") and not r.get("match_set"):     # a copy kept in the data: by its URL too
                row["match_url"] = _url_of(run_dir, r["match_key"])
            if name == "shard" and r.get("tar"):
                row.update(tar=r["tar"], offset=r.get("offset"))
                row["detail"] = f"{r['tar']} at byte {r.get('offset')}"
            out.append(row)
        if rows and rows[0]["verdict"] == "dropped":
            break
    out += _removals_of(run_dir, key)
    if not any(r["stage"] != "(input)" for r in out):
        for as_key in _as_keys(key):
            if as_key != key:
                try:
                    return explain(where, as_key)
                except UserError:
                    continue
        raise UserError(f"no sample with key {key!r} in {run_dir.uri()} "
                        f"(see the key column of {run_dir.uri('source/ledger')}/)")
    return out


def _as_keys(typed: str) -> list[str]:
    """The keys a list's own id becomes, as the source stage makes them: a float id's integer form
    (1000056.0 -> 1000056, source._ids), then '.' and '/' made '_' (7.5 -> 7_5)."""
    try:
        number = float(typed)
        whole = [str(int(number))] if number.is_integer() and "." in typed else []
    except ValueError:
        whole = []
    return whole + [typed.replace(".", "_").replace("/", "_")]


def _removals_of(run_dir, key: str) -> list[dict]:
    """A published sample that `capline remove` or `recheck` took out since: which removal, when, why,
    and the shard rewritten without it (its old version kept)."""
    from stages.shard.line import read_line

    line = read_line(run_dir) or {}
    out = []
    for r in line.get("removals") or []:
        if key in (r.get("keys") or ()):
            tar = (r.get("where") or {}).get(key)
            where = f"; {tar} rewritten without it (as it was: {r.get('versions')}/{tar})" if tar else ""
            out.append({"key": key, "stage": "removed", "verdict": "removed", "reason": f"removal {r.get('removal')}",
                        "score": None, "detail": f"{r.get('reason', '')} at {r.get('at', '?')}{where}"})
    return out


def _url_of(run_dir, key: str) -> str | None:
    """A sample's URL from the source stage's ledger (through its key index: one small read)."""
    from stages.base import read_ledger

    from .key_index import lookup

    file = lookup(run_dir, "source", key)
    if file is None:
        rows = read_ledger(run_dir, "source", ["url"], filters=[("key", "==", key)]).to_pylist()
    else:
        rows = pq.read_table(run_dir.path(file), filesystem=run_dir.fs, columns=["url"],
                             filters=[("key", "==", key)]).to_pylist() if file else []
    return rows[0]["url"] if rows else None


def printable(text) -> str:
    """Text from the data (URLs, captions, servers' reason phrases) made safe for a terminal: control
    characters, escape sequences (ESC, CSI) and bidirectional overrides shown as \\xNN / \\uNNNN."""
    import unicodedata

    out = []
    for ch in str(text):
        cat = unicodedata.category(ch)
        if cat in ("Cc", "Cf", "Zl", "Zp") and ch != " ":
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def format_explain(key: str, rows: list[dict]) -> str:
    lines = [f"sample {printable(key)}:"]
    for r in rows:
        if r["stage"] == "(input)":
            lines.append(f"  input      {printable(r['detail'])}")
            continue
        score = "" if r["score"] is None else f" score={r['score']:.4g}"
        why = f" ({printable(r['reason'])})" if r["reason"] else ""
        detail = f"  [{printable(r['detail'])}]" if r["detail"] else ""
        lines.append(f"  {r['stage']:<10} {r['verdict']}{why}{score}{detail}")
        if r.get("match_url"):
            lines.append(f"  {'':<10} the copy kept: {printable(r['match_key'])} {printable(r['match_url'])}")
    return "\n".join(lines)
