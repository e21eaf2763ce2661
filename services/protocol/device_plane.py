"""The feature ring's data on a GPU: one device buffer the verifier allocates and the co-located drafter
maps through CUDA IPC, so a commit's features go device -> device and never through the host.

The verifier (`DevicePlane.create`) owns the buffer and two interprocess CUDA events; `handle()` describes
all three as plain JSON values (no pickle crosses the socket), and the drafter opens them
(`DevicePlane.open`) on the local device with the same UUID (containers of one host may number their
GPUs differently; no such device: ValueError, and the ring keeps its data in shared memory).

Ordering without a host sync, per record:
- verifier `write`: its current stream waits `consumed` (the drafter's copy of the previous records is
  done), copies the features into the buffer, records `written`;
- drafter `read`: its current stream waits `written`, copies the record out, records `consumed`.
The drafter's reply comes after its draft, which reads the finished tree on the host, so its copies have
run before the verifier writes again; `consumed` keeps that true on the device as well.

Offsets and sizes are checked by the ring (feature_ring.py) against its host-side record headers before
any of this is touched.
"""

from __future__ import annotations

import dataclasses

import torch

_HEX_FIELDS = ("storage_handle", "ref_counter_handle", "event_handle", "written_event", "consumed_event")
_INT_FIELDS = ("storage_size", "storage_offset", "ref_counter_offset", "size")


@dataclasses.dataclass(frozen=True)
class DevicePlaneHandle:
    """What the drafter needs to map the verifier's buffer and events (torch's CUDA IPC fields)."""

    device_uuid: str
    storage_handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    written_event: bytes
    consumed_event: bytes
    size: int  # the ring's bytes

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        for name in _HEX_FIELDS:
            out[name] = out[name].hex()
        return out

    @classmethod
    def from_json(cls, raw) -> DevicePlaneHandle:
        """ValueError for anything but the fields `to_json` writes, of their types."""
        if not isinstance(raw, dict) or set(raw) != {f.name for f in dataclasses.fields(cls)}:
            raise ValueError("a device plane handle has exactly the fields of DevicePlaneHandle")
        values = dict(raw)
        try:
            for name in _HEX_FIELDS:
                values[name] = bytes.fromhex(raw[name])
        except (TypeError, ValueError):
            raise ValueError("device plane handle: IPC handles must be hex strings") from None
        if not all(isinstance(raw[n], int) and raw[n] >= 0 for n in _INT_FIELDS):
            raise ValueError("device plane handle: sizes and offsets must be non-negative ints")
        if not isinstance(raw["device_uuid"], str) or not isinstance(raw["event_sync_required"], bool):
            raise ValueError("device plane handle: device_uuid is a string, event_sync_required a bool")
        return cls(**values)


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device_with_uuid(uuid: str) -> torch.device:
    for i in range(torch.cuda.device_count()):
        device = torch.device("cuda", i)
        if device_uuid(device) == uuid:
            return device
    raise ValueError(f"no local CUDA device has the verifier's ring's UUID {uuid[:64]!r}")


class DevicePlane:
    def __init__(self, buffer: torch.Tensor, written: torch.cuda.Event, consumed: torch.cuda.Event, handle=None):
        self.buffer = buffer  # uint8 [size] on the ring's device
        self._written, self._consumed = written, consumed
        self._handle = handle  # the exporter's, for handle()

    @classmethod
    def create(cls, size: int, device: torch.device) -> DevicePlane:
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        written = torch.cuda.Event(interprocess=True)
        consumed = torch.cuda.Event(interprocess=True)
        with torch.cuda.device(device):
            consumed.record()  # nothing to wait for before the first write
            written.record()
        fields = buffer.untyped_storage()._share_cuda_()
        handle = DevicePlaneHandle(
            device_uuid(device), fields[1], fields[2], fields[3], fields[4], fields[5], fields[6], bool(fields[7]),
            written.ipc_handle(), consumed.ipc_handle(), size,
        )  # fmt: skip
        return cls(buffer, written, consumed, handle)

    @classmethod
    def open(cls, handle: DevicePlaneHandle) -> DevicePlane:
        """The drafter's mapping of a verifier's plane; ValueError when this process cannot open it."""
        device = local_device_with_uuid(handle.device_uuid)
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                device.index, handle.storage_handle, handle.storage_size, handle.storage_offset,
                handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle, handle.event_sync_required,
            )  # fmt: skip
            buffer = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (handle.size,), (1,))
            written = torch.cuda.Event.from_ipc_handle(device, handle.written_event)
            consumed = torch.cuda.Event.from_ipc_handle(device, handle.consumed_event)
        except RuntimeError as err:
            raise ValueError(f"cannot map the verifier's feature buffer: {str(err)[:200]}") from None
        if storage.nbytes() < handle.size:
            raise ValueError(f"the verifier's feature buffer holds {storage.nbytes()} bytes, not {handle.size}")
        return cls(buffer, written, consumed)

    def handle(self) -> DevicePlaneHandle:
        assert self._handle is not None, "only the verifier's plane is exported"
        return self._handle

    def write(self, at: int, data: torch.Tensor) -> None:
        """data: uint8 [n], on any device (a host tensor is copied up)."""
        with torch.cuda.device(self.buffer.device):
            stream = torch.cuda.current_stream()
            stream.wait_event(self._consumed)
            self.buffer[at : at + data.numel()].copy_(data, non_blocking=True)
            self._written.record(stream)

    def read(self, at: int, nbytes: int) -> torch.Tensor:
        """A copy of bytes [at, at + nbytes) on the plane's device (uint8), ordered after the verifier's write."""
        with torch.cuda.device(self.buffer.device):
            stream = torch.cuda.current_stream()
            stream.wait_event(self._written)
            out = self.buffer[at : at + nbytes].clone()
            self._consumed.record(stream)
        return out
