"""DNS discovery of replicas: a name stands for every address it resolves to."""

from __future__ import annotations

import pytest

from ddtree.gateway.routing import Router
from ddtree.protocol.discovery import resolve


def test_resolve_lists_and_names():
    assert resolve("127.0.0.1:5,127.0.0.1:6") == ["127.0.0.1:5", "127.0.0.1:6"]
    assert resolve(["127.0.0.1:5", "127.0.0.1:5"]) == ["127.0.0.1:5"]
    assert "127.0.0.1:7" in resolve("localhost:7")
    assert resolve("no-such-host.invalid:7") == []
    with pytest.raises(ValueError, match="not HOST:PORT"):
        resolve("nohostport")


def test_router_expands_names_and_keeps_unresolved_ones():
    router = Router(["localhost:7", "no-such-host.invalid:9"])
    try:
        assert "127.0.0.1:7" in router.addresses
        assert "no-such-host.invalid:9" in router.addresses
        before = len(router.addresses)
        router.discover()  # nothing new behind the names
        assert len(router.addresses) == before
    finally:
        router.close()
