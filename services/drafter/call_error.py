"""A Draft call that fails as a whole, with the gRPC status it answers (the co-located channel sends the same)."""

from __future__ import annotations

import grpc


class DraftCallError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details
