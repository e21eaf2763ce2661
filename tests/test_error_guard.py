"""A handler's unexpected exception (a bug) reaches the client as INTERNAL without its text; a status the
handler sets itself (context.abort) passes through unchanged; streams and unary calls alike."""

from __future__ import annotations

import grpc
import pytest

from ddtree.protocol.server import start_server

SECRET = "secret internals /etc/passwd"


def _unary_bug(request, context):
    raise ValueError(SECRET)


def _unary_abort(request, context):
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad field x")


def _unary_ok(request, context):
    return request + b"!"


def _stream_bug(request, context):
    yield b"first"
    raise RuntimeError(SECRET)


def _stream_abort(request, context):
    yield b"first"
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")


@pytest.fixture(scope="module")
def channel():
    def register(server):
        handlers = {
            "UnaryBug": grpc.unary_unary_rpc_method_handler(_unary_bug),
            "UnaryAbort": grpc.unary_unary_rpc_method_handler(_unary_abort),
            "UnaryOk": grpc.unary_unary_rpc_method_handler(_unary_ok),
            "StreamBug": grpc.unary_stream_rpc_method_handler(_stream_bug),
            "StreamAbort": grpc.unary_stream_rpc_method_handler(_stream_abort),
        }
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Guarded", handlers)])
        return ["test.Guarded"]

    running = start_server("guarded", register, "127.0.0.1", 0, 4, 0.0, announce=False)
    ch = grpc.insecure_channel(running.address)
    yield ch
    ch.close()
    running.stop(0)


def test_unary_bug_is_internal_without_text(channel):
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary("/test.Guarded/UnaryBug")(b"x", timeout=10)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == "guarded: internal error (logged)"
    assert channel.unary_unary("/test.Guarded/UnaryOk")(b"x", timeout=10) == b"x!"


def test_stream_bug_is_internal_without_text(channel):
    call = channel.unary_stream("/test.Guarded/StreamBug")(b"x", timeout=10)
    assert next(call) == b"first"
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.INTERNAL and SECRET not in (err.value.details() or "")


@pytest.mark.parametrize(
    "method, kind, code, details",
    [
        ("UnaryAbort", "unary_unary", grpc.StatusCode.INVALID_ARGUMENT, "bad field x"),
        ("StreamAbort", "unary_stream", grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
    ],
)
def test_abort_passes_through(channel, method, kind, code, details):
    with pytest.raises(grpc.RpcError) as err:
        call = getattr(channel, kind)(f"/test.Guarded/{method}")(b"x", timeout=10)
        if kind == "unary_stream":
            list(call)
    assert err.value.code() == code and err.value.details() == details
