"""The co-located drafter channel: frames over a Unix socket beside the drafter's gRPC port.

When a verifier and its drafter run on one host, a Draft call skips gRPC: the verifier writes each
sequence's commit features into its feature ring (feature_ring.py: shared memory, or a GPU buffer shared
through CUDA IPC) and sends the DraftRequest, with `FeatureRef`s in place of the bytes, as one frame over
the drafter's Unix socket; the drafter answers with one frame. gRPC stays the path for remote drafters,
and any failure of this one.

Frame: 4-byte big-endian length of what follows, 1 kind byte, the payload. Kinds:
- AUTH, verifier -> drafter, first when the services share a token: the service token (UTF-8); a drafter
  with a token closes a connection whose first frame is not AUTH with it (the socket's directory is
  private to the drafter's user besides);
- HELLO, verifier -> drafter: the ring (`FeatureRing.hello`'s JSON); answered REPLY b"device" when the
  drafter mapped the ring's GPU buffer, b"host" when it reads the ring's shared memory;
- DRAFT: a serialized DraftRequest; answered REPLY (a DraftResponse) or ERROR (UTF-8 "CODE: details",
  for a call that failed as a whole, as gRPC would have aborted it);
- APPEND: one serialized CommitChunk of a long commit, its features in the ring; answered REPLY (an
  AppendResponse for that chunk) or ERROR, as the gRPC Append stream would end.
"""

from __future__ import annotations

import os
import socket
import struct

HELLO, DRAFT, REPLY, ERROR, APPEND, AUTH = 1, 2, 3, 4, 5, 6
MAX_FRAME = 64 << 20  # bytes: a Draft call's message without its features is far smaller


def send_frame(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(struct.pack(">IB", len(payload) + 1, kind) + payload)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    """The next frame (kind, payload); ConnectionError when the peer closed or sent a malformed frame."""
    (length,) = struct.unpack(">I", _recv_exact(sock, 4))
    if not 1 <= length <= MAX_FRAME:
        raise ConnectionError(f"frame of {length} bytes (1..{MAX_FRAME})")
    body = _recv_exact(sock, length)
    return body[0], body[1:]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the channel")
        buf += chunk
    return bytes(buf)


def host_id() -> str:
    """This host's identity for the co-location check: its boot id, which every container of one host
    shares and no other host has (as NCCL identifies hosts); the hostname where /proc does not say.
    Containers of one host that share neither the socket's nor the ring's directory (/dev/shm: compose's
    `ipc`) pass the check, then fail to connect or to open the ring, and keep to gRPC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"boot:{boot}" if boot else f"host:{socket.gethostname()}"


def shared_dir() -> str:
    """Where the channel's socket and the feature ring live: /dev/shm, which containers can share (compose's
    `ipc: host` or `ipc: service:...`), else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
