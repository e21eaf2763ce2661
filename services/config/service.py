"""What every service has: where it listens, how it logs and shuts down, and how it authenticates."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Literal

from .flags import ConfigBase, option

# Where the default (demo) checkpoints are unpacked: $DDTREE_HOME, else ~/.cache/ddtree.
DEFAULT_CHECKPOINT_DIR = pathlib.Path(os.environ.get("DDTREE_HOME", pathlib.Path.home() / ".cache" / "ddtree"))


@dataclasses.dataclass(frozen=True)
class SecurityConfig(ConfigBase):
    """How a process authenticates to, and accepts calls from, the other services
    (`ddtree.protocol.security`); every service has these, and so does `ddtree health`."""

    flag_group = "security between the services"

    service_token: str = option(
        "",
        "shared secret between gateway, verifier and drafter: required on calls into the verifier and the "
        "drafter, sent on calls out ('' = none; prefer DDTREE_SERVICE_TOKEN or --service-token-file)",
    )
    service_token_file: str = option("", "file holding the service token (instead of --service-token)")
    tls_ca: str = option("", "PEM CA certificate for mutual TLS between the services ('' = plaintext)")
    tls_cert: str = option("", "PEM certificate of this service (mutual TLS)")
    tls_key: str = option("", "PEM private key of this service (mutual TLS)")
    tls_server_name: str = option("", "name checked in the certificates of the services called ('' = the host dialled)")

    def validate(self) -> None:
        super().validate()
        if self.service_token and self.service_token_file:
            raise ValueError("set service_token or service_token_file, not both")
        tls = {"tls_ca": self.tls_ca, "tls_cert": self.tls_cert, "tls_key": self.tls_key}
        if any(tls.values()) and not all(tls.values()):
            missing = ", ".join(name for name, path in tls.items() if not path)
            raise ValueError(f"mutual TLS needs tls_ca, tls_cert and tls_key; missing {missing}")


@dataclasses.dataclass(frozen=True)
class ServiceConfig(SecurityConfig):
    """The fields of every service: its gRPC server, logs and metrics, and its security."""

    flag_group = "service"

    host: str = option("127.0.0.1", "address to bind")
    port: int = option(0, "port to bind (0 = any free port)", at_least=0, at_most=65535)
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "lowest level of log lines written")
    log_format: Literal["json", "console"] = option("json", "log lines as JSON objects or as text for a console")
    grace_s: float = option(5.0, "seconds in-flight RPCs get to finish on shutdown", at_least=0)
    max_workers: int = option(
        32,
        "gRPC handler threads for unary calls and health checks (streams get their own: the verifier's "
        "max_batch + max_queue, the gateway's max_streams); calls beyond them get RESOURCE_EXHAUSTED",
        at_least=1,
    )
    metrics_port: int = option(-1, "Prometheus metrics port (-1 = off, 0 = any free port)")
