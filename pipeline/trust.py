"""One trust model: a config that came with a run folder, a manifest or a dataset line is data.

Whoever wrote it (a colleague, a bucket's previous owner, an attacker) did not choose, for this user:
- the Ray cluster to join (the user's Ray token is sent there): `ray.address` is dropped;
- code to run: a TorchScript encoder (`stages.dedup.encoder_checkpoint`) runs its `__setstate__` and
  `forward` when loaded, and a pin (`encoder_sha256`) written by the same hand is not consent. It
  loads only when the user names that file on the command line (`--trust-code FILE`).
The user's own choices are the command line (`--address`, `--set`, `--trust-code`), the environment
and a config the user names. Every command that reads such a config calls `from_elsewhere`; the
test that lists every command that starts or joins Ray checks that each one does.
"""
from __future__ import annotations

from pathlib import Path

from infra.errors import UserError


def from_elsewhere(cfg, where: str, overrides=(), trust_code=(), log=print, loads_code: bool = True):
    """`cfg` (read from `where`, a file the user did not write) with what it may not decide taken
    out or refused; the user's own `--set KEY=...` for a setting keeps it. `loads_code`: the command
    runs stages that load the code a config names (remove and recheck do not)."""
    own = {o.split("=", 1)[0] for o in overrides or ()}
    if cfg.ray.address and "ray.address" not in own:
        log(f"capline: not joining the Ray cluster {cfg.ray.address!r} that {where} names: a cluster address is "
            "taken from --address, RAY_ADDRESS or a config you name")
        cfg.ray.address = None
    if loads_code:
        _code_named(cfg, where, own, trust_code)
    return cfg


def _code_named(cfg, where: str, own: set, trust_code) -> None:
    from stages.dedup.config import torchscript_file

    path = cfg.stages.dedup.encoder_checkpoint
    if not path or "stages.dedup.encoder_checkpoint" in own:
        return
    script = torchscript_file(path)
    if script is None:
        return   # a capline model folder: weights read without pickle, no code
    trusted = {Path(t).expanduser().resolve() for t in trust_code or ()}
    if script.resolve() not in trusted:
        raise UserError(f"{where} names TorchScript {script} as stages.dedup.encoder_checkpoint: a TorchScript file "
                        "runs code when it is loaded, and a pin written in the same file is not your consent; to run "
                        f"it, name it yourself: --trust-code {script}")
