"""`manifest.json`: what a run was built from and what it produced.

The config and its hash, capline's git revision, package versions, the seed, each input's
fingerprint, each finished stage's input/output digests, and MLflow run ids as trainers add them.
Written atomically (temp file + rename) after every stage, so it is never half-written.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from importlib import metadata
from pathlib import Path

PACKAGES = ("capline", "torch", "ray", "pyarrow", "webdataset", "img2dataset", "faiss-cpu",
            "sentencepiece", "mlflow", "numpy", "Pillow")


def git_revision() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("+dirty" if dirty else "")) if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


class Manifest:
    def __init__(self, path: Path, data: dict):
        self.path = path
        self.data = data

    @classmethod
    def open(cls, run_dir: Path, config: dict, config_hash: str, seed: int, inputs: dict) -> "Manifest":
        path = run_dir / "manifest.json"
        data = json.loads(path.read_text()) if path.is_file() else {}
        data.update({
            "config": config, "config_hash": config_hash, "seed": seed, "inputs": inputs,
            "git_revision": git_revision(), "packages": package_versions(),
            "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })
        data.setdefault("stages", {})
        data.setdefault("artifacts", {})
        data.setdefault("mlflow_runs", {})
        m = cls(path, data)
        m.save()
        return m

    def record_stage(self, name: str, marker: dict, artifacts: dict | None = None) -> None:
        """The stage's digests and when it finished, and how many files it made: sized by stages, not
        partitions (every file with its sha256 stays in the stage's own `_SUCCESS`)."""
        self.data["stages"][name] = {**{k: v for k, v in marker.items() if k not in ("files", "outputs", "driver_files", "artifacts")},
                                     "files": len(marker.get("files", {})), "outputs": len(marker.get("outputs", {}))}
        if artifacts:
            self.data["artifacts"][name] = artifacts
        else:
            self.data["artifacts"].pop(name, None)
        self.save()

    def save(self) -> None:
        write_json_atomic(self.path, self.data)
