"""capline's network guard: an audit hook that refuses every non-loopback connection.

This folder goes on PYTHONPATH (capline does it when CAPLINE_NETGUARD=1, and the test suite always
does), so every Python process capline starts -- Ray's raylet-launched workers and dashboard,
img2dataset's spawned processes, MLflow -- inherits the hook. A refused attempt raises OSError in
the caller and is appended to CAPLINE_NETGUARD_LOG, so tests can fail on any attempt at all.

CAPLINE_NETGUARD_ALLOW: extra comma-separated host prefixes to allow.
"""
import os
import sys

_LOOPBACK = ("127.", "localhost", "::1", "0.0.0.0", "")
_EVENTS = ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.sendto")


def _host(event, args):
    target = args[1] if event in ("socket.connect", "socket.sendto") else args[0]
    if event in ("socket.connect", "socket.sendto") and not isinstance(target, tuple):
        return None  # a Unix socket path
    host = target[0] if isinstance(target, tuple) else target
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    return None if host is None else str(host)


def install():
    if getattr(sys, "_capline_netguard", False):
        return
    sys._capline_netguard = True
    allowed = _LOOPBACK + tuple(p for p in os.environ.get("CAPLINE_NETGUARD_ALLOW", "").split(",") if p)
    log = os.environ.get("CAPLINE_NETGUARD_LOG")

    def hook(event, args):
        if event not in _EVENTS:
            return
        host = _host(event, args)
        if host is None or host.startswith(allowed):
            return
        if log:
            try:
                with open(log, "a") as f:
                    prog = os.path.basename(sys.argv[0]) if sys.argv else "?"
                    f.write(f"{os.getpid()} {prog} {event} {host}\n")
            except OSError:
                pass
        raise OSError(101, f"capline netguard: refused a connection to {host}")

    sys.addaudithook(hook)


install()
