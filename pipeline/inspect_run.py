"""`capline status` and `capline explain`: read a run folder, print what happened."""
from __future__ import annotations

import json
from pathlib import Path


from trainers.errors import UserError

from .runner import read_marker, stage_names


def _require_run(run_dir: Path) -> None:
    if not (run_dir / "manifest.json").is_file():
        raise UserError(f"{run_dir}: not a capline run folder (no manifest.json)")


def status_rows(run_dir: Path) -> list[dict]:
    _require_run(run_dir)
    rows = []
    for name in stage_names():
        sdir = run_dir / name
        stats_path = sdir / "stats.json"
        if read_marker(sdir):
            state = "done"
        elif (sdir / "_STARTED").exists():
            state = "incomplete"
        else:
            state = "pending"
        stats = json.loads(stats_path.read_text()) if state == "done" and stats_path.is_file() else {}
        rows.append({"stage": name, "state": state, "in": stats.get("in"), "kept": stats.get("kept"),
                     "dropped": stats.get("dropped", {}), "wall_seconds": stats.get("wall_seconds")})
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


def explain(run_dir: Path, key: str) -> list[dict]:
    _require_run(run_dir)
    out = []
    from stages.base import has_ledger, read_ledger

    for name in stage_names():
        if not has_ledger(run_dir, name):
            continue
        rows = read_ledger(run_dir, name, filters=[("key", "==", key)]).to_pylist()
        if name == "source" and rows:
            out.append({"stage": "(input)", "verdict": "", "reason": "", "score": None,
                        "detail": f"url={rows[0]['url']} caption={rows[0]['caption']!r}"})
        out.extend({c: r[c] for c in ("key", "stage", "verdict", "reason", "score", "detail")} for r in rows)
        if rows and rows[0]["verdict"] == "dropped":
            break
    if not any(r["stage"] != "(input)" for r in out):
        raise UserError(f"no sample with key {key!r} in {run_dir} "
                        f"(see the key column of {run_dir}/source/ledger/)")
    return out


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
    return "\n".join(lines)
