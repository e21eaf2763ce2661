"""The verifier's end of the co-located drafter channel (protocol/local_channel.py).

`LocalDrafterChannel.open(info, ring_bytes, device)` connects when the drafter's GetInfo offers a socket
and names this host, makes this verifier's feature ring (its data on `device` when that is a GPU and the
drafter maps it, else in shared memory) and says HELLO; None when any of it fails (the client keeps to
gRPC). A Draft call's features go into the ring (`put_all`: their FeatureRefs, or None when they do not
fit it), the request and the reply as one frame each; a long commit's earlier chunks go one APPEND frame
each (`append`), their features through the ring too. Failures are gRPC errors (`LocalRpcError`), so the
drafter pool treats them as it treats gRPC's: a reply not in time is DEADLINE_EXCEEDED; a broken channel
is `ChannelBroken`, after which the client closes it and sends that call and the rest over gRPC.
"""

from __future__ import annotations

import socket

import grpc
import torch

from ddtree.protocol.ddtree.v1 import drafter_pb2
from ddtree.protocol.feature_ring import FeatureRing
from ddtree.protocol.local_channel import APPEND, AUTH, DRAFT, ERROR, HELLO, REPLY, host_id, recv_frame, send_frame
from ddtree.protocol.tensors import proto_dtype
from ddtree.telemetry.logging import get_logger

log = get_logger("ddtree.verifier.drafting.local_drafter")


class LocalRpcError(grpc.RpcError):
    """A failed call of the local channel, as gRPC reports one (code(), details())."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class ChannelBroken(ConnectionError):
    """The local channel cannot carry calls any more (the drafter closed it, a malformed frame)."""


class LocalDrafterChannel:
    def __init__(self, sock: socket.socket, ring: FeatureRing):
        self._sock, self.ring = sock, ring

    @classmethod
    def open(
        cls, info: drafter_pb2.DrafterInfo, ring_bytes: int, device: torch.device | None = None, token: str = ""
    ) -> LocalDrafterChannel | None:
        """token: the service token, sent first (AUTH) when there is one."""
        if not info.local_address or info.host_id != host_id():
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ring = None
        try:
            sock.settimeout(10.0)
            sock.connect(info.local_address)
            # a GPU buffer only for a drafter that maps one: one it never maps stays allocated (CUDA IPC)
            ring = FeatureRing.create(ring_bytes, device=device if info.maps_device_features else None)
            if token:
                send_frame(sock, AUTH, token.encode())
            send_frame(sock, HELLO, ring.hello())
            kind, plane = recv_frame(sock)
            if kind != REPLY or plane not in (b"device", b"host"):
                raise ConnectionError("the drafter refused the feature ring")
            ring.unlink()  # the drafter has it mapped now
            if plane == b"host":
                ring.use_host()
        except (OSError, ConnectionError, RuntimeError) as err:
            log.info("drafter_local_channel_unused", address=info.local_address, reason=str(err)[:200])
            sock.close()
            if ring is not None:
                ring.close(unlink=True)
            return None
        log.info("drafter_local_channel", address=info.local_address, ring_bytes=ring_bytes,
                 features="device" if ring.device is not None else "shared memory")  # fmt: skip
        return cls(sock, ring)

    def put_all(self, features: dict[str, torch.Tensor]) -> dict[str, drafter_pb2.FeatureRef] | None:
        """Write one call's commit features into the ring; their references, or None when a record is too
        large for it or all of them together would wrap onto each other (the call then goes over gRPC)."""
        sizes = {rid: f.numel() * f.element_size() for rid, f in features.items()}
        if not all(self.ring.fits(n) for n in sizes.values()):
            return None
        if sum(self.ring.record_bytes(n) for n in sizes.values()) > self.ring.size // 2:
            return None
        refs = {}
        for rid, f in features.items():
            offset, nbytes, generation = self.ring.write(f)
            refs[rid] = drafter_pb2.FeatureRef(
                offset=offset, nbytes=nbytes, generation=generation, shape=list(f.shape), dtype=proto_dtype(f.dtype)
            )
        return refs

    def draft(self, request: drafter_pb2.DraftRequest, timeout_s: float) -> drafter_pb2.DraftResponse:
        return self._call(DRAFT, request, drafter_pb2.DraftResponse, timeout_s)

    def append(
        self, chunk: drafter_pb2.CommitChunk, features: torch.Tensor, timeout_s: float
    ) -> drafter_pb2.AppendResponse | None:
        """One chunk of a long commit, its features through the ring; None when they do not fit it."""
        refs = self.put_all({chunk.seq_id: features})
        if refs is None:
            return None
        chunk.commit_features_ref.CopyFrom(refs[chunk.seq_id])
        return self._call(APPEND, chunk, drafter_pb2.AppendResponse, timeout_s)

    def _call(self, kind: int, message, reply_type, timeout_s: float):
        """One frame and its reply; the errors of gRPC's (LocalRpcError), or ChannelBroken."""
        try:
            self._sock.settimeout(timeout_s)
            send_frame(self._sock, kind, message.SerializeToString())
            reply_kind, payload = recv_frame(self._sock)
        except TimeoutError:
            # the reply may still come: this channel is out of step for good
            self.close()
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {timeout_s:.3g} s") from None
        except (OSError, ConnectionError) as err:
            self.close()
            raise ChannelBroken(str(err)) from None
        if reply_kind == ERROR:
            code_name, _, details = payload.decode(errors="replace").partition(": ")
            code = getattr(grpc.StatusCode, code_name, grpc.StatusCode.UNKNOWN)
            raise LocalRpcError(code, details)
        if reply_kind != REPLY:
            self.close()
            raise ChannelBroken(f"reply frame of kind {reply_kind}")
        try:
            return reply_type.FromString(payload)
        except Exception as err:  # a malformed reply: the channel is not to be trusted any more
            self.close()
            raise ChannelBroken(f"malformed reply: {err}") from None

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            self._sock.close()
            self.ring.close(unlink=True)
