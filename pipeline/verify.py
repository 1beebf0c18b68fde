"""`capline verify` and `capline rebuild`'s drift report.

verify RUN_DIR: every final shard against the checksums in manifest.json (and sizes.json against
the tar contents). verify RUN_DIR OTHER: byte-identical, or which samples differ and how.
"""
from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path


from infra.hashing import hash_file as sha256_file
from infra.errors import UserError


def _manifest(run_dir: Path) -> dict:
    path = run_dir / "manifest.json"
    if not path.is_file():
        raise UserError(f"{run_dir}: not a capline run folder (no manifest.json)")
    return json.loads(path.read_text())


def _shard_list(run_dir: Path, manifest: dict) -> list[dict]:
    shards = manifest.get("artifacts", {}).get("shard", {}).get("shards")
    if shards is None:
        raise UserError(f"{run_dir}: the shard stage has not finished; nothing to verify")
    return shards


def verify_run(run_dir: Path) -> tuple[list[str], int]:
    """-> (problems, shards checked)."""
    manifest = _manifest(run_dir)
    shards = _shard_list(run_dir, manifest)
    folder = run_dir / "shard" / "shards"
    problems = []
    sizes_path = folder / "sizes.json"
    sizes = json.loads(sizes_path.read_text()) if sizes_path.is_file() else {}
    for s in shards:
        path = folder / s["name"]
        if not path.is_file():
            problems.append(f"shard {s['name']}: missing")
            continue
        if path.stat().st_size != s["bytes"] or sha256_file(path) != s["sha256"]:
            problems.append(f"shard {s['name']}: checksum differs from manifest.json "
                            f"({path.stat().st_size} bytes, expected {s['bytes']}): modified or truncated")
            continue
        if sizes.get(s["name"]) != s["samples"]:
            problems.append(f"shard {s['name']}: sizes.json says {sizes.get(s['name'])} samples, manifest {s['samples']}")
    tok = manifest.get("artifacts", {}).get("tokenizer")
    if tok:
        model = run_dir / tok["model"]
        if not model.is_file() or sha256_file(model) != tok["sha256"]:
            problems.append(f"tokenizer {tok['model']}: missing or checksum differs from manifest.json")
    return problems, len(shards)


def sample_digests(run_dir: Path) -> dict[str, dict[str, str]]:
    """key -> {member extension: sha256} over every final shard."""
    from infra.tars import tar_samples

    out: dict[str, dict[str, str]] = {}
    for path in sorted((run_dir / "shard" / "shards").glob("*.tar")):
        for key, parts in tar_samples(path):
            for ext, data in parts.items():
                out.setdefault(key, {})[ext] = hashlib.sha256(data).hexdigest()
    return out


MAX_JSON_DIFFS = 200


def sample_jsons(run_dir: Path, keys: set) -> dict[str, dict]:
    """key -> the sample's json, for `keys` only."""
    import json

    from infra.tars import tar_samples

    out = {}
    if not keys:
        return out
    for path in sorted((run_dir / "shard" / "shards").glob("*.tar")):
        for key, parts in tar_samples(path):
            if key in keys and "json" in parts:
                try:
                    out[key] = json.loads(parts["json"])
                except ValueError:
                    out[key] = {"(not JSON)": parts["json"][:80].decode("utf-8", "replace")}
    return out


def file_digests(run_dir: Path) -> dict[str, str]:
    """shard name -> sha256 of the file on disk now (not what a manifest says it was)."""
    _shard_list(run_dir, _manifest(run_dir))   # a run whose shard stage finished
    return {p.name: sha256_file(p) for p in sorted((run_dir / "shard" / "shards").glob("*.tar"))}


def compare_runs(a: Path, b: Path) -> list[str]:
    """[] when the two runs' shard files are byte-identical, read from disk; else lines naming what
    differs (a file that does not parse as a tar is named, not compared member by member)."""
    fa, fb = file_digests(a), file_digests(b)
    if fa == fb and fa:
        return []
    unreadable = []
    for run, files in ((a, fa), (b, fb)):
        for name in files:
            try:
                with tarfile.open(run / "shard" / "shards" / name) as tar:
                    for _ in tar:
                        pass
            except (tarfile.TarError, OSError, EOFError) as err:
                unreadable.append(f"{run}/shard/shards/{name}: not a readable tar ({type(err).__name__}: {err})")
    if unreadable:
        return unreadable + [f"shard {n}: sha256 differs" for n in sorted(set(fa) & set(fb)) if fa[n] != fb[n]]
    da, db = sample_digests(a), sample_digests(b)
    lines = []
    for key in sorted(set(da) - set(db)):
        lines.append(f"{key}: only in {a}")
    for key in sorted(set(db) - set(da)):
        lines.append(f"{key}: only in {b}")
    changed = {}
    for key in sorted(set(da) & set(db)):
        if da[key] != db[key]:
            changed[key] = sorted(ext for ext in set(da[key]) | set(db[key]) if da[key].get(ext) != db[key].get(ext))
    # a differing json: which of its fields, and their two values (read again, only these samples)
    wanted = {k for k, exts in list(changed.items())[:MAX_JSON_DIFFS] if "json" in exts}
    ja, jb = sample_jsons(a, wanted), sample_jsons(b, wanted)
    for key, exts in changed.items():
        fields = ""
        if key in ja and key in jb:
            names = sorted(f for f in set(ja[key]) | set(jb[key]) if ja[key].get(f) != jb[key].get(f))
            fields = " (json: " + "; ".join(f"{f} {ja[key].get(f)!r} -> {jb[key].get(f)!r}"[:160] for f in names) + ")"
        lines.append(f"{key}: {', '.join(exts)} differ{fields}")
    if not lines:
        lines.append("the same samples with the same bytes, but laid out in different shards")
    return lines


def drift(old_run: Path, new_run: Path) -> dict:
    """URLs that died and URLs whose content changed between two runs' downloads."""
    def load(run):
        from stages.base import has_ledger, read_ledger

        if not has_ledger(run, "ingest"):
            raise UserError(f"{run}: no ingest ledger to compare downloads with")
        t = read_ledger(run, "ingest", ["key", "verdict", "sha256"]).to_pydict()
        return {k: ("success" if v == "kept" else "failed", h) for k, v, h in zip(t["key"], t["verdict"], t["sha256"])}

    old, new = load(old_run), load(new_run)
    died = sorted(k for k, (s, _) in old.items() if s == "success" and new.get(k, ("missing", None))[0] != "success")
    changed = sorted(k for k, (s, h) in old.items()
                     if s == "success" and new.get(k, ("", None))[0] == "success" and new[k][1] != h)
    revived = sorted(k for k, (s, _) in old.items() if s != "success" and new.get(k, ("", None))[0] == "success")
    return {"died": died, "changed": changed, "revived": revived}
