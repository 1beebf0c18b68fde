"""The network guard really refuses outside connections, in child processes too; Ray left to its
defaults probes cloud metadata addresses (the guard catches it), and Ray started the capline way
does not."""
import os
import subprocess
import sys

import pytest

from infra import offline

# The probe checks that the guard is installed before it tries anything, so a broken guard fails
# the test without a single packet leaving the machine.
PROBE = """
import socket, sys
if not getattr(sys, "_capline_netguard", False):
    print("NO GUARD")
    sys.exit(0)
try:
    socket.create_connection(("169.254.169.254", 80), timeout=1)
    print("CONNECTED")
except OSError as e:
    print("REFUSED", e)
"""


def test_guard_refuses_and_logs_in_a_child_process(tmp_path):
    log = tmp_path / "refused.log"
    env = offline.guard_env({k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, str(log))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert "REFUSED" in out.stdout and "capline netguard" in out.stdout
    assert "169.254.169.254" in log.read_text()


def test_guard_lets_loopback_through(tmp_path):
    log = tmp_path / "refused.log"
    code = ("import socket\ns=socket.socket(); s.bind(('127.0.0.1',0)); s.listen()\n"
            "c=socket.create_connection(s.getsockname(), timeout=2); print('OK')")
    env = offline.guard_env(dict(os.environ), str(log))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "OK"
    assert not log.exists() or log.read_text() == ""


def test_quiet_switches_are_set_for_children():
    for key in ("RAY_USAGE_STATS_ENABLED", "MLFLOW_DISABLE_TELEMETRY", "NO_ALBUMENTATIONS_UPDATE", "WANDB_MODE"):
        assert os.environ.get(key) == offline.QUIET_ENV[key]


RAY_START = """
import ray, sys, time
assert getattr(sys, "_capline_netguard", False), "guard not installed: not starting Ray"
ray.init(num_cpus=1, include_dashboard=True, dashboard_host="127.0.0.1", object_store_memory=100 * 2**20,
         _node_ip_address="127.0.0.1")
time.sleep(12)
ray.shutdown()
"""


def _ray_probes(tmp_path, **extra_env) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "refused.log"
    env = {**offline.guard_env(dict(os.environ), str(log)), **extra_env}
    subprocess.run([sys.executable, "-c", RAY_START], env=env, capture_output=True, text=True, timeout=180)
    return log.read_text() if log.exists() else ""


@pytest.mark.slow
def test_rays_own_metadata_probe_is_caught_and_capline_disarms_it(tmp_path):
    # CAPLINE_TELEMETRY=1: Ray as it comes. Its dashboard head probes metadata services at start-up.
    leaky = _ray_probes(tmp_path / "a", CAPLINE_TELEMETRY="1")
    assert "169.254.169.254" in leaky or "metadata.google.internal" in leaky, leaky
    # capline's default: the probe is replaced on import, nothing is attempted.
    quiet = _ray_probes(tmp_path / "b")
    assert quiet == "", quiet


def test_the_per_test_check_reads_the_log_children_write():
    """A child process started the ordinary way logs to the file the autouse check reads."""
    from conftest import _GUARD_LOG, guard_log_lines

    before = guard_log_lines()
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert "REFUSED" in out.stdout
    after = guard_log_lines()
    assert len(after) == len(before) + 1 and "169.254.169.254" in after[-1]
    _GUARD_LOG.write_text("".join(line + "\n" for line in before))  # this one was on purpose


EXACT = """
import socket, sys
assert getattr(sys, "_capline_netguard", False)
for host in sys.argv[1:]:
    try:
        socket.getaddrinfo(host, 80)
        print(host, "PASSED")
    except OSError as e:
        print(host, "GUARD" if "capline netguard" in str(e) else "PASSED")
"""


def test_guard_compares_parsed_addresses_not_prefixes(tmp_path):
    # text prefixes let "::127.0.0.1" (an IPv4-compatible address, not loopback) and any DNS name
    # starting "127." or "localhost" through; parsed addresses do not
    hosts = {"127.0.0.1": "PASSED", "127.3.2.1": "PASSED", "::1": "PASSED", "::ffff:127.0.0.1": "PASSED",
             "localhost": "PASSED", "::127.0.0.1": "GUARD", "127.evil.example": "GUARD",
             "localhost.evil.example": "GUARD", "::1.evil.example": "GUARD", "169.254.169.254": "GUARD",
             "10.9.8.7": "PASSED", "10.9.9.1": "GUARD", "mirror.internal": "PASSED"}
    env = offline.guard_env(dict(os.environ), str(tmp_path / "refused.log"))
    env["CAPLINE_NETGUARD_ALLOW"] = "10.9.8.0/24,mirror.internal"
    out = subprocess.run([sys.executable, "-c", EXACT, *hosts], env=env, capture_output=True, text=True, timeout=60)
    got = dict(line.rsplit(" ", 1) for line in out.stdout.splitlines())
    assert got == hosts, out.stderr[-2000:]
