"""Loaded at start-up by every Python process capline starts (this folder is on their PYTHONPATH).

1. Unless CAPLINE_TELEMETRY=1: Ray's dashboard head probes cloud metadata addresses at start-up
   (usage_stats_head -> usage_lib.get_cloud_from_metadata_requests) whatever the usage-stats
   setting and even with include_dashboard=False (then it loads *only* that module). Nothing in
   Ray turns it off, so the function is replaced, on import, by one that answers "unknown".
   A `ray start` cluster with usage stats disabled also POSTs a "disabled" report to
   usage-stats.ray.io; the report client's send is replaced by one that sends nothing.
2. If CAPLINE_NETGUARD=1: an audit hook refuses every connection that does not stay on this
   machine and appends it to CAPLINE_NETGUARD_LOG, so tests (and the demo) can prove nothing leaves
   the machine. Addresses are parsed, never compared as text: loopback (127/8, ::1 and their
   IPv4-mapped forms), the unspecified address of a bind, this machine's own interface addresses
   and the names `localhost` and this host's name pass; `::127.0.0.1` or a DNS name that starts
   with "127." do not. CAPLINE_NETGUARD_ALLOW adds comma-separated hosts or CIDR networks.
3. With RAY_enable_metrics_collection=0 (capline's default): Ray's dashboard head and autoscaler
   start Prometheus /metrics servers on 0.0.0.0 that answer without Ray's token; they are bound to
   loopback instead (prometheus_client's start_http_server is wrapped on import).
"""
import importlib.abc
import importlib.machinery
import os
import sys

_EVENTS = ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.sendto")
_RAY_USAGE = "ray._common.usage.usage_lib"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Run `patch(module)` right after `name` is first imported."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, self.patch
        original = loader.exec_module

        def exec_module(module):
            original(module)
            patch(module)

        loader.exec_module = exec_module
        return spec


def _no_cloud_probe(module):
    module.get_cloud_from_metadata_requests = lambda: "unknown"
    # A cluster started with `ray start` (not ray.init) POSTs a "usage stats disabled" report to
    # usage-stats.ray.io precisely when usage stats are disabled; nothing is ever reported here.
    client = getattr(module, "UsageReportClient", None)
    if client is not None:
        client.report_usage_data = lambda self, url, data: None


def _loopback_metrics(module):
    original = module.start_wsgi_server

    def start_wsgi_server(port, addr="0.0.0.0", *args, **kwargs):
        if addr in ("", "0.0.0.0", "::"):
            addr = "127.0.0.1"
        return original(port, addr, *args, **kwargs)

    module.start_wsgi_server = module.start_http_server = start_wsgi_server


def _host(event, args):
    target = args[1] if event in ("socket.connect", "socket.sendto") else args[0]
    if event in ("socket.connect", "socket.sendto") and not isinstance(target, tuple):
        return None  # a Unix socket path
    host = target[0] if isinstance(target, tuple) else target
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    return None if host is None else str(host)


def _own_addresses():
    """This machine's own name and interface addresses: talking to them stays on the machine."""
    import re
    import socket

    own = {socket.gethostname()}
    try:
        with open("/proc/net/fib_trie") as f:
            own.update(re.findall(r"\|-- ([0-9.]+)\n\s+/32 host LOCAL", f.read()))
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                raw = line.split()[0]
                own.add(":".join(raw[i:i + 4] for i in range(0, 32, 4)))
                own.add(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(raw)))
    except (OSError, ValueError):
        pass
    return tuple(a for a in own if a)


class _Allowed:
    """Which hosts stay on this machine: exact names, parsed addresses and networks."""

    def __init__(self, extra):
        import ipaddress

        self.ipaddress = ipaddress
        self.names = {"localhost", "localhost.localdomain"}
        self.addresses, self.networks = set(), []
        for item in (*_own_addresses(), *extra):
            item = item.strip()
            try:
                if "/" in item:
                    self.networks.append(ipaddress.ip_network(item, strict=False))
                else:
                    self.addresses.add(ipaddress.ip_address(item.split("%")[0]))
            except ValueError:
                self.names.add(item.lower().rstrip("."))

    def __call__(self, host: str) -> bool:
        try:
            ip = self.ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            return host.lower().rstrip(".") in self.names
        mapped = getattr(ip, "ipv4_mapped", None)
        if mapped is not None:
            ip = mapped
        return (ip.is_loopback or ip.is_unspecified or ip in self.addresses
                or any(ip.version == n.version and ip in n for n in self.networks))


def install_guard():
    if getattr(sys, "_capline_netguard", False):
        return
    sys._capline_netguard = True
    allowed = _Allowed([p for p in os.environ.get("CAPLINE_NETGUARD_ALLOW", "").split(",") if p.strip()])
    log = os.environ.get("CAPLINE_NETGUARD_LOG")

    def hook(event, args):
        if event not in _EVENTS:
            return
        host = _host(event, args)
        # "" and None are getaddrinfo's wildcard (a bind)
        if host is None or host == "" or allowed(host):
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


def install():
    if os.environ.get("CAPLINE_TELEMETRY", "") not in ("1", "true", "yes"):
        if not any(isinstance(f, _PatchOnImport) and f.name == _RAY_USAGE for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport(_RAY_USAGE, _no_cloud_probe))
            if _RAY_USAGE in sys.modules:  # imported before us (only possible in-process)
                _no_cloud_probe(sys.modules[_RAY_USAGE])
    if os.environ.get("RAY_enable_metrics_collection") == "0":
        name = "prometheus_client.exposition"
        if not any(isinstance(f, _PatchOnImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport(name, _loopback_metrics))
            if name in sys.modules:
                _loopback_metrics(sys.modules[name])
    if os.environ.get("CAPLINE_NETGUARD") == "1":
        install_guard()


install()
