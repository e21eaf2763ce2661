"""Service discovery by DNS: a HOST:PORT list where each name may stand for several replicas.

docker compose gives one A record per replica of a scaled service, so resolving the service name
finds them all; callers re-resolve periodically to see replicas come and go.
"""

from __future__ import annotations

import socket

from ddtree.telemetry.logging import get_logger

log = get_logger("ddtree.discovery")


def resolve(spec: str | list[str]) -> list[str]:
    """'a:1,b:2' -> every address each name resolves to, as 'ip:port' (IPv6 in brackets), in order."""
    out: list[str] = []
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    for item in (s.strip() for s in items):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"address {item!r} is not HOST:PORT")
        host = host.strip("[]")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as err:
            log.warning("resolve_failed", host=host, error=str(err))
            continue
        for family, _, _, _, addr in infos:
            ip = f"[{addr[0]}]" if family == socket.AF_INET6 else addr[0]
            if f"{ip}:{port}" not in out:
                out.append(f"{ip}:{port}")
    return out
