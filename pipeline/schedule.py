"""`capline run --incremental`: what a scheduled run should do, decided from the last completed run.

A run that finishes every stage records `completed` in manifest.json: when, and the input
fingerprints it ran on (for a URL folder: each partition file's name and sha256). An incremental run
compares the source with that record: nothing new and every stage done -> nothing to do (said, and
Ray is not even started); new partition files -> named, then the pipeline runs and ingest downloads
only them (finished partitions are content-addressed and reused); a changed or removed partition is
named too, as drift, and the affected stages recompute.
"""
from __future__ import annotations

import json
from pathlib import Path


def plan(inputs: dict, run_dir: Path) -> tuple[bool, str]:
    """-> (run needed, a line saying why)."""
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.is_file():
        return True, "incremental: no earlier run in this folder; running everything"
    manifest = json.loads(manifest_path.read_text())
    done = manifest.get("completed")
    if not done:
        return True, "incremental: the last run did not complete; resuming it"
    old = done.get("inputs", {}).get("source", {})
    new = inputs.get("source", {})
    if old.get("kind") != new.get("kind"):
        return True, f"incremental: the source changed from {old.get('kind')} to {new.get('kind')}; running everything"
    if "files" not in new:   # generated sources: one fingerprint, no partitions
        if old == new:
            return False, f"incremental: nothing new since the run completed at {done['at']}; nothing to do"
        return True, "incremental: the source changed; running"
    old_files, new_files = old.get("files", {}), new["files"]
    added = sorted(set(new_files) - set(old_files))
    removed = sorted(set(old_files) - set(new_files))
    changed = sorted(f for f in set(old_files) & set(new_files) if old_files[f] != new_files[f])
    if not (added or removed or changed):
        return False, (f"incremental: no new partitions since the run completed at {done['at']} "
                       f"({len(new_files)} partitions); nothing to do")
    parts = []
    if added:
        parts.append(f"{len(added)} new partition(s): {', '.join(added[:5])}{' ...' if len(added) > 5 else ''}")
    if changed:
        parts.append(f"{len(changed)} changed since the last run: {', '.join(changed[:5])}")
    if removed:
        parts.append(f"{len(removed)} removed: {', '.join(removed[:5])}")
    return True, "incremental: " + "; ".join(parts)
