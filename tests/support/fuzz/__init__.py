"""The fuzz and fault suite of issue 20 ("hardening"); the runner is `tests/support/fuzz_suite.py`.

- `common`: the suite's settings, the result record, the stack it runs on (and restarts services of).
- `streams`: timed gRPC / HTTP SSE stream clients, the workload prompts and their reference outputs, the canary.
- `http_cases`: seeded mutations of valid HTTP requests to every gateway endpoint.
- `grpc_cases`: seeded mutations of valid messages (and raw bytes) to every RPC of the three services.
- `faults`: drafter SIGSTOP / SIGKILL, verifier SIGKILL and restart, mass disconnects, KV exhaustion,
  request-id reuse.
"""
