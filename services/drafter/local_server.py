"""The drafter's end of the co-located channel (protocol/local_channel.py): a Unix socket beside its gRPC
port, one thread per connected verifier.

A connection starts with HELLO (the verifier's feature ring, feature_ring.py): the ring is mapped
read-only, its GPU buffer too when one is offered and this drafter runs on a GPU (`map_device`), and
answered REPLY b"device" or b"host" (where this drafter will read the features), or the connection is
closed (a ring it cannot open: the verifier then keeps to gRPC). A device buffer it cannot map (no GPU
of that UUID here, IPC refused) is not an error: the features then come through shared memory.

Then each DRAFT frame is served by the same code as the gRPC Draft (`serve_draft`), each APPEND frame (one
chunk of a long commit) by the gRPC Append's (`serve_chunk`), the FeatureRefs read from the ring, and
answered with REPLY, or ERROR "CODE: details" for a call that fails as a whole. A malformed frame closes
that connection only.
"""

from __future__ import annotations

import hmac
import os
import socket
import tempfile
import threading

from google.protobuf.message import DecodeError

from ddtree.drafter.call_error import DraftCallError
from ddtree.protocol.ddtree.v1 import drafter_pb2
from ddtree.protocol.feature_ring import FeatureRing
from ddtree.protocol.local_channel import APPEND, AUTH, DRAFT, ERROR, HELLO, REPLY, recv_frame, send_frame, shared_dir
from ddtree.telemetry.logging import get_logger

log = get_logger("ddtree.drafter.local")


class LocalDraftServer:
    def __init__(self, servicer, directory: str = "", thread_init=None, map_device: bool = False, token: str = ""):
        """Listen on a new socket in `directory` ('' = local_channel.shared_dir(), which co-located containers
        can share with the verifier's), serving `servicer.serve_draft`;
        thread_init: run first on each connection's thread (models/runtime/cpu: no OpenMP pool of its own);
        map_device: map a ring's GPU buffer when a verifier offers one; token: the service token a connection
        must send first (AUTH), '' = none."""
        self.servicer = servicer
        self._token = token
        self._map_device = map_device
        self._thread_init = thread_init
        self._dir = tempfile.mkdtemp(prefix="ddtree-drafter-", dir=directory or shared_dir())
        self.path = os.path.join(self._dir, "draft.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(16)
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_loop, name="draft-local-accept", daemon=True).start()
        log.info("draft_local_channel", path=self.path)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="draft-local", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        ring = None
        if self._thread_init is not None:
            self._thread_init()
        try:
            kind, payload = recv_frame(conn)
            if kind == AUTH:
                sent, (kind, payload) = payload, recv_frame(conn)
            else:
                sent = None
            if self._token and (sent is None or not hmac.compare_digest(sent, self._token.encode())):
                raise ConnectionError("no valid service token (AUTH) first")
            if kind != HELLO:
                raise ConnectionError(f"first frame of kind {kind}, expected HELLO")
            ring = FeatureRing.from_hello(payload, self._map_device)
            if ring.device_refused:
                log.info("draft_local_device_plane_unused", reason=ring.device_refused[:200])
            send_frame(conn, REPLY, b"host" if ring.device is None else b"device")
            while True:
                kind, payload = recv_frame(conn)
                try:
                    if kind == DRAFT:
                        reply = self.servicer.serve_draft(drafter_pb2.DraftRequest.FromString(payload), ring)
                    elif kind == APPEND:
                        nbytes, compute_s = self.servicer.serve_chunk(
                            0, drafter_pb2.CommitChunk.FromString(payload), ring
                        )
                        reply = drafter_pb2.AppendResponse(chunks=1, feature_bytes=nbytes, append_ms=compute_s * 1e3)
                    else:
                        raise ConnectionError(f"frame of kind {kind}, expected DRAFT or APPEND")
                except DraftCallError as err:
                    send_frame(conn, ERROR, f"{err.code.name}: {err.details}".encode())
                    continue
                send_frame(conn, REPLY, reply.SerializeToString())
        except (ConnectionError, OSError, DecodeError, UnicodeDecodeError, ValueError) as err:
            if not self._closed.is_set():
                log.info("draft_local_connection_closed", reason=str(err)[:200])
        finally:
            if ring is not None:
                ring.close()
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        with self._lock:
            for conn in self._connections:
                conn.shutdown(socket.SHUT_RDWR)
        for name in (self.path,):
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
