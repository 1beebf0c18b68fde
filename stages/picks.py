"""Which samples a stage's examples page shows, per partition: for each reason (and "kept") the first
`per_reason` rows in one order (nearest the stage's cut, then by sha256(seed:key)). Computed where the
partition's ledger is written, from the rows in hand (dataplane.write_part), so nothing reads a
ledger again to pick; merged over partitions by stages/examples.py."""
from __future__ import annotations

from collections import defaultdict

import pyarrow as pa

from infra.hashing import order_key

COLUMNS = ["key", "verdict", "reason", "score", "detail", "caption", "tar", "offset", "size"]


def order(seed: int, cut: float | None):
    """Sort key: distance to the cut (samples without a score last), then the seeded order."""
    def key(r):
        near = abs(r["score"] - cut) if cut is not None and r["score"] is not None else float("inf")
        return (near, order_key(seed, r["key"]))
    return key


def pick_rows(table: pa.Table, per_reason: int, seed: int, cut: float | None = None) -> dict[str, list[dict]]:
    """One partition's first `per_reason` rows per reason in that order (columns it lacks: None)."""
    have = [c for c in COLUMNS if c in table.column_names]
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in table.select(have).to_pylist():
        groups[r["reason"] or "kept"].append({**{c: None for c in COLUMNS}, **r})
    return {reason: sorted(rows, key=order(seed, cut))[:per_reason] for reason, rows in groups.items()}
