"""The run config: one typed section per component, loaded from YAML plus `--set` overrides.

Sections are defined next to what they configure (stages/source/stage.py, stages/ingest/stage.py,
infra/ray_runtime.py); this module only assembles them and loads files.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from stages.registry import sections
from stages.source.stage import SourceConfig
from infra.configtools import MAX_CONFIG_BYTES, apply_override, build, parse_yaml, require
from trainers.evaluation.config import EvalConfig
from trainers.train_config import TrainConfig
from infra.errors import UserError

from infra.ray_runtime import RayConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


# one section per stage that declares one (stages/registry.py), in stage order
StagesConfig = dataclasses.make_dataclass(
    "StagesConfig", [(key, cls, field(default_factory=cls)) for key, cls in sections()])
StagesConfig.__module__ = __name__


@dataclass
class RunConfig:
    name: str = "demo"  # the run's name: its default folder runs/<name> and MLflow's run names
    seed: int = 0  # every seeded choice (samples, order keys, training): same seed, same dataset
    # a dataset that grows run after run (scheduled runs over an appended list): published shards stay
    # byte for byte, new samples go to new shards, and the tokenizer, the bootstrap scorer and the
    # clip_score cut are the line's own. One switch for the four settings that make it (LINE_SETTINGS)
    dataset_line: bool = False
    run_dir: str | None = None   # default: runs/<name>
    track_data: bool = True      # log a data-build run to MLflow after the shard stage
    ray: RayConfig = field(default_factory=RayConfig)
    source: SourceConfig = field(default_factory=SourceConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self, prefix: str) -> None:
        require(bool(self.name) and "/" not in self.name and "\\" not in self.name and self.name not in (".", ".."),
                "name", f"must be one folder name (runs/<name>), not a path, '.' or '..', got {self.name!r}")
        require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.is_file():
        raise UserError(f"config file {path}: no such file")
    with open(path, "rb") as f:       # no more than the cap is read, however large the file
        data = parse_yaml(f.read(MAX_CONFIG_BYTES + 1), f"config file {path}") or {}
    if not isinstance(data, dict):
        raise UserError(f"config file {path}: expected a mapping at the top level")
    data = copy.deepcopy(data)
    for item in overrides or []:
        apply_override(data, item)
    _dataset_line(data)
    if isinstance(data.get("train"), dict):
        from trainers.train_config import with_recipe

        data["train"] = with_recipe(data["train"])
    return build(RunConfig, data)


LINE_SETTINGS = (("stages", "shard", "append"), ("stages", "tokenizer", "reuse"),
                 ("stages", "clip_score", "bootstrap", "reuse"), ("stages", "clip_score", "reuse_cut"))


def _dataset_line(data: dict) -> None:
    """`dataset_line: true` turns on each of LINE_SETTINGS; one set false beside it is a contradiction."""
    if data.get("dataset_line") is not True:
        return
    for path in LINE_SETTINGS:
        where = data
        for key in path[:-1]:
            where = where.setdefault(key, {})
            if not isinstance(where, dict):
                raise UserError(f"{'.'.join(path[:path.index(key) + 1])}: expected a mapping")
        name = ".".join(path)
        if where.get(path[-1]) is False:
            raise UserError(f"{name}: false contradicts dataset_line: true (which sets it true); remove {name}, "
                            "or set dataset_line: false")
        where[path[-1]] = True


def save_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
