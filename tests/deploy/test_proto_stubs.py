"""The committed gRPC stubs are exactly what the committed .proto files generate."""

from __future__ import annotations

from scripts.data.gen_proto import DEFAULT_OUT, generate


def test_committed_stubs_are_fresh(tmp_path):
    written = generate(tmp_path)
    assert written, "no stubs generated"
    stale = []
    for fresh in written:
        rel = fresh.relative_to(tmp_path)
        committed = DEFAULT_OUT / rel
        if not committed.exists() or committed.read_bytes() != fresh.read_bytes():
            stale.append(str(rel))
    extra = {p.relative_to(DEFAULT_OUT) for p in (DEFAULT_OUT / "ddtree" / "v1").glob("*_pb2*.py")}
    extra -= {p.relative_to(tmp_path) for p in written}
    assert not stale, f"stale stubs {stale}: run `python -m scripts.data.gen_proto`"
    assert not extra, f"stubs without a .proto: {sorted(map(str, extra))}"


def test_every_service_of_the_contract_is_present():
    from ddtree.protocol.ddtree.v1 import drafter_pb2, gateway_pb2, verifier_pb2

    assert set(drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].methods_by_name) == {
        "Draft",
        "Append",
        "Release",
        "GetInfo",
    }
    assert set(verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].methods_by_name) == {
        "Generate",
        "Features",
        "Abort",
        "GetInfo",
    }
    assert set(gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].methods_by_name) == {
        "Chat",
        "Complete",
        "Tokenize",
        "GetInfo",
    }
