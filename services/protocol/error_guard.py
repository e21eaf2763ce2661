"""No exception text ever reaches a client: an exception a handler did not turn into a status (a bug)
is logged with its method and answered INTERNAL "<service>: internal error (logged)".

grpcio would answer such an exception UNKNOWN "Exception calling application: <the exception's text>".
`context.abort` raises too, after setting the call's status: those pass through untouched.
"""

from __future__ import annotations

import grpc

from ddtree.telemetry.logging import get_logger

log = get_logger("ddtree.protocol")


def _aborted(context: grpc.ServicerContext) -> bool:
    code = context.code()
    return code is not None and code != grpc.StatusCode.OK


class ErrorGuard(grpc.ServerInterceptor):
    def __init__(self, service: str):
        self._service = service

    def _fail(self, context: grpc.ServicerContext, method: str, err: Exception):
        log.error("rpc_unhandled", service=self._service, method=method, error=f"{type(err).__name__}: {err}")
        context.abort(grpc.StatusCode.INTERNAL, f"{self._service}: internal error (logged)")

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        guard = self

        def unary(behavior):
            def run(request, context):
                try:
                    return behavior(request, context)
                except Exception as err:
                    if _aborted(context):
                        raise
                    guard._fail(context, method, err)

            return run

        def streaming(behavior):
            def run(request, context):
                try:
                    yield from behavior(request, context)
                except Exception as err:
                    if _aborted(context):
                        raise
                    guard._fail(context, method, err)

            return run

        kinds = {
            (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler, unary),
            (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler, streaming),
            (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler, unary),
            (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler, streaming),
        }
        attr, make, wrap = kinds[(handler.request_streaming, handler.response_streaming)]
        return make(
            wrap(getattr(handler, attr)),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
