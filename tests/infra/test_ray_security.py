"""capline's local Ray cluster with token authentication: whatever interfaces Ray binds (it binds
all of them), a client without the token cannot join, the job-submission API refuses it, nothing
answers plain HTTP without it, and the cluster's temp folder is the user's alone. A token file
another user could read or have written is refused."""
import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request

import psutil
import pytest

from helpers import ROOT


HOLD = """
import json, os, sys, time
from infra import offline
offline.apply()
from infra.ray_runtime import RayConfig, ray_session
import ray
with ray_session(RayConfig(num_cpus=1, object_store_memory_mb=100), log=lambda m: None):
    ctx = ray.get_runtime_context()
    print(json.dumps({"gcs": ctx.gcs_address, "session": ray._private.worker.global_worker.node.get_session_dir_path(), "token": os.environ.get("RAY_AUTH_TOKEN_PATH"),
                      "mode": os.environ.get("RAY_AUTH_MODE"), "dashboard": ray.worker.get_dashboard_url()}), flush=True)
    sys.stdin.read()      # hold the cluster until the test closes stdin
"""


def test_a_token_file_others_can_read_or_wrote_is_refused(tmp_path, monkeypatch):
    from infra import offline
    from infra.errors import UserError

    monkeypatch.setenv("HOME", str(tmp_path))
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("t" * 64)
    os.chmod(token, 0o644)                 # as Ray 2.60 writes it
    with pytest.raises(UserError, match=f"readable by other users \\(mode 644\\).*run: chmod 600 {token}"):
        offline.ray_auth(joining=False)
    os.chmod(token, 0o600)
    assert offline.ray_auth(joining=False) == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    monkeypatch.delenv("RAY_AUTH_MODE")
    if os.geteuid() == 0:                   # root can hand the file to another user
        os.chown(token, 65534, 65534)
        with pytest.raises(UserError, match="belongs to uid 65534, not to you"):
            offline.ray_auth(joining=False)
        os.chown(token, 0, 0)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    os.chmod(token, 0o640)
    with pytest.raises(UserError, match="RAY_AUTH_TOKEN_PATH .* is readable by other users"):
        offline.ray_auth(joining=False)
    # capline's own token, already there: used as it was made, never chmodded into use; no link
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    token.unlink()
    monkeypatch.setenv("CAPLINE_CACHE", str(tmp_path / "cache"))
    mine = tmp_path / "cache" / "ray_auth_token"
    mine.parent.mkdir()
    elsewhere = tmp_path / "planted"
    elsewhere.write_text("p" * 64)
    os.chmod(elsewhere, 0o666)
    os.symlink(elsewhere, mine)
    with pytest.raises(UserError, match="is a symbolic link"):
        offline.ray_auth(joining=False)
    mine.unlink()
    mine.write_text("w" * 64)
    os.chmod(mine, 0o666)                   # world-writable: anyone could have chosen it
    with pytest.raises(UserError, match="readable by other users"):
        offline.ray_auth(joining=False)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o666      # left as found, not chmodded
    os.chmod(mine, 0o600)
    assert offline.ray_auth(joining=False)["RAY_AUTH_TOKEN_PATH"] == str(mine)


@pytest.mark.slow
def test_an_unauthenticated_client_is_refused(tmp_path):
    env = {**os.environ, "CAPLINE_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path / "home")}
    env = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    holder = subprocess.Popen([sys.executable, "-c", HOLD], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(holder.stdout.readline())
        assert info["mode"] == "token"
        token = info["token"]
        assert token == str(tmp_path / "cache" / "ray_auth_token")
        assert stat.S_IMODE(os.stat(token).st_mode) == 0o600 and len(open(token).read()) == 64

        # what Ray listens on (it ignores the loopback node address for these): every one needs the token
        listening = {(p.name(), c.laddr.ip) for p in [psutil.Process(holder.pid), *psutil.Process(holder.pid).children(
            recursive=True)] for c in _listening(p)}
        print("listening:", sorted(listening))
        assert any(ip not in ("127.0.0.1", "::1") for _, ip in listening)   # why the token matters
        # nothing off loopback answers plain HTTP without the token (Ray's metrics servers did, on 0.0.0.0)
        for p in [psutil.Process(holder.pid), *psutil.Process(holder.pid).children(recursive=True)]:
            for c in _listening(p):
                if c.laddr.ip in ("127.0.0.1", "::1"):
                    continue        # loopback only: the metrics servers are moved there
                ip = "127.0.0.1" if c.laddr.ip in ("0.0.0.0", "::") else c.laddr.ip
                try:
                    answer = urllib.request.urlopen(f"http://{ip}:{c.laddr.port}/metrics", timeout=5).status
                except urllib.error.HTTPError as e:
                    answer = e.code
                except Exception:  # not HTTP (gRPC), or closed
                    answer = None
                assert answer in (None, 401, 403, 404), (p.name(), c.laddr, answer)
        # the session folder is inside a folder only this user can enter
        root = os.path.dirname(os.path.dirname(info["session"]))
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700 and os.stat(root).st_uid == os.geteuid(), root

        code = f"import ray; ray.init(address={info['gcs']!r}); print('JOINED')"
        for extra in ({"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}):
            client_env = {**{k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}, **extra}
            out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=client_env, capture_output=True,
                                 text=True, timeout=120)
            assert out.returncode != 0 and "JOINED" not in out.stdout, (extra, out.stdout[-500:], out.stderr[-500:])
        # the job-submission API (where a job runs code) without the token
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://{info['dashboard']}/api/jobs/", timeout=10)
        assert err.value.code == 401
        # and with it: the cluster works for the one who holds the token
        ok = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120, capture_output=True, text=True,
                            env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token})
        assert "JOINED" in ok.stdout, ok.stderr[-1000:]
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def _listening(proc):
    try:
        return [c for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _commands_that_start_ray() -> list[str]:
    """Every subcommand that takes --address: the ones that start or join a Ray cluster."""
    from pipeline.cli import _parser

    sub = next(a for a in _parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return sorted(n for n, p in sub.choices.items() if any("--address" in a.option_strings for a in p._actions))


def _folder_from_elsewhere(tmp_path, *settings: str):
    """A run folder someone else wrote: its config.yaml and manifest name `settings`; a dataset line."""
    import json

    from pipeline.config import load_config
    from pipeline.runner import input_fingerprints

    foreign = load_config(None, list(settings))
    old = tmp_path / "old"
    (old / "shard" / "line").mkdir(parents=True)
    (old / "config.yaml").write_text(json.dumps(foreign.to_dict()))
    (old / "manifest.json").write_text(json.dumps({"config": foreign.to_dict(), "inputs": input_fingerprints(foreign),
                                                   "stages": {"source": {}, "ingest": {}}}))
    (old / "shard" / "line" / "line.json").write_text(json.dumps({"shards": [], "runs": []}))
    (old / "shard" / "shards").mkdir()
    (old / "shard" / "_SUCCESS").touch()
    (old / "tokenizer").mkdir()
    (old / "tokenizer" / "spm.model").touch()
    (tmp_path / "takedown.txt").write_text("url http://example.invalid/1.jpg\n")
    return old


def _argv(command: str, old, tmp_path) -> list[str]:
    return {"run": ["run", "--run-dir", str(old)], "train": ["train", "--run-dir", str(old)],
            "experiment": ["experiment", "paper", "--run-dir", str(old), "--models", "cap"],
            "rebuild": ["rebuild", str(old / "manifest.json"), "--run-dir", str(tmp_path / "new")],
            "remove": ["remove", str(old), "--list", str(tmp_path / "takedown.txt"), "--reason", "test"],
            "recheck": ["recheck", str(old)]}[command]


def test_every_command_that_starts_ray_is_listed_here():
    """A new command that can join a cluster is checked by the test below, or this fails."""
    assert _commands_that_start_ray() == ["experiment", "rebuild", "recheck", "remove", "run", "train"]


@pytest.mark.parametrize("command", _commands_that_start_ray())
def test_a_manifest_or_run_folder_from_elsewhere_does_not_choose_the_cluster(command, tmp_path, monkeypatch, capsys):
    """Every command that reads a run folder's config or manifest (rebuild, train --run-dir, and, in
    round four, remove and recheck too) joined the ray.address written there, sending the user's Ray
    token to whatever listened: the address now comes only from --address, RAY_ADDRESS, a config the
    user names or their own --set."""
    import infra.ray_runtime as ray_runtime
    from pipeline import cli

    joined = []

    class Stop(Exception):
        pass

    def record(cfg, address=None, log=print, trains=True):
        joined.append((cfg.address, address))
        raise Stop

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_runtime, "ray_session", record)
    old = _folder_from_elsewhere(tmp_path, "ray.address=10.9.9.9:6379")
    try:
        cli.main(_argv(command, old, tmp_path))
    except Stop:
        pass
    out, err = capsys.readouterr()
    # train on this bare folder is refused before Ray starts (no finished stages): the address is
    # dropped all the same, by the same code as run's
    assert joined == [(None, None)] or (command == "train" and not joined and "--only train" in err), (joined, out, err)
    assert "not joining the Ray cluster '10.9.9.9:6379'" in out


def test_the_users_own_set_chooses_the_cluster(tmp_path):
    from pipeline.config import load_config
    from pipeline.trust import from_elsewhere

    saved = from_elsewhere(load_config(None, ["ray.address=10.9.9.9:6379"]), "x", ["ray.address=10.9.9.9:6379"])
    assert saved.ray.address == "10.9.9.9:6379"           # the user's own --set is the user's choice

@pytest.mark.parametrize("command", ["rebuild", "run"])
def test_torchscript_a_foreign_config_names_and_pins_runs_only_when_the_user_names_it(command, tmp_path, monkeypatch,
                                                                                     capsys):
    """`capline rebuild` ran the __setstate__ of a TorchScript that the manifest named and pinned
    itself (exit 0, no word): a pin written by the same hand is not consent. Refused before anything
    loads or starts, naming --trust-code; with --trust-code FILE the command goes on."""
    import torch

    import infra.ray_runtime as ray_runtime
    from infra.hashing import hash_file
    from pipeline import cli

    class Payload(torch.nn.Module):
        def forward(self, x):
            return x.flatten(1)

    path = tmp_path / "isc.pt"
    torch.jit.trace(Payload(), torch.zeros(1, 3, 8, 8)).save(str(path))
    old = _folder_from_elsewhere(tmp_path, f"stages.dedup.encoder_checkpoint={path}",
                                 f"stages.dedup.encoder_sha256={hash_file(path)}")
    started = []

    class Stop(Exception):
        pass

    def record(cfg, address=None, log=print, trains=True):
        started.append(True)
        raise Stop

    monkeypatch.setattr(ray_runtime, "ray_session", record)
    argv = _argv(command, old, tmp_path)
    assert cli.main(argv) != 0
    err = capsys.readouterr().err
    assert f"--trust-code {path}" in err and "not your consent" in err, err
    assert not started                       # refused before a cluster (and so the stages) started
    try:
        cli.main(argv + ["--trust-code", str(path)])
    except Stop:
        pass
    assert started == [True], capsys.readouterr()
