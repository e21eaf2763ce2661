"""The verifier's feature ring: where a co-located drafter reads each Draft call's commit features.

A file of `size` bytes in shared memory that both processes map. A record is a 16-byte header
(generation, nbytes: two little-endian u64) at a 64-byte boundary, then its data; records follow each
other and wrap to offset 0 when the next does not fit. The data is in the file itself (the host plane), or,
when the verifier runs on a GPU and the drafter could map it, at the same offsets of a device buffer
shared through CUDA IPC (device_plane.py): then the file holds only the headers. The file's pages are
allocated when it is made (so a full /dev/shm refuses the ring rather than failing a write later).

Invariants:
- the verifier writes only between calls, and one call's records never overwrite each other (`fits`
  allows half the ring per record, `DrafterClient` at most the ring per call);
- the drafter copies a record while it serves the call that names it, after checking the reference
  against the header: an offset off the 64-byte grid or out of bounds, or a header of another
  generation or size (stale, forged, overwritten) is a ValueError for that record alone.
"""

from __future__ import annotations

import json
import mmap
import os
import struct

import torch

from .device_plane import DevicePlane, DevicePlaneHandle
from .local_channel import shared_dir

_HEADER = struct.Struct("<QQ")  # generation, nbytes
_ALIGN = 64
RING_PREFIX = "ddtree-features-"
MAX_HELLO = 1 << 16  # bytes of a HELLO's JSON


class FeatureRing:
    def __init__(self, path: str, size: int, writable: bool):
        self.path, self.size = path, size
        flags = os.O_RDWR if writable else os.O_RDONLY
        fd = os.open(path, flags)
        try:
            self._map = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        # The verifier's view of the file as a tensor (copies into it take any device's tensor).
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8) if writable else None
        self.device: DevicePlane | None = None  # where the data lives when not in the file
        self.device_refused = ""  # the drafter's: why an offered device plane is not used
        self._pos, self._generation = 0, 0

    @classmethod
    def create(cls, size: int, directory: str | None = None, device: torch.device | None = None) -> FeatureRing:
        """The verifier's ring; device: a CUDA device to keep the data on (offered to the drafter at HELLO)."""
        if size < 4 * _ALIGN:
            raise ValueError(f"a feature ring needs at least {4 * _ALIGN} bytes, got {size}")
        path = os.path.join(directory or shared_dir(), f"{RING_PREFIX}{os.getpid()}-{os.urandom(6).hex()}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # The pages now, all of them: a write into a full tmpfs through the mapping would be a SIGBUS; here
            # it is an OSError (ENOSPC) and the verifier keeps to gRPC.
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        ring = cls(path, size, writable=True)
        if device is not None and device.type == "cuda":
            ring.device = DevicePlane.create(size, device)
        return ring

    @classmethod
    def attach(cls, path: str) -> FeatureRing:
        """Map a verifier's ring read-only: a regular file named as `create` names them, nothing else."""
        if not os.path.basename(path).startswith(RING_PREFIX) or not os.path.isfile(path):
            raise ValueError(f"not a feature ring: {path[:200]!r}")
        return cls(path, os.path.getsize(path), writable=False)

    def hello(self) -> bytes:
        """What the verifier's HELLO carries: the file, and the device plane's handle when there is one."""
        plane = None if self.device is None else self.device.handle().to_json()
        return json.dumps({"path": self.path, "device_plane": plane}).encode()

    @classmethod
    def from_hello(cls, payload: bytes, use_device: bool) -> FeatureRing:
        """The drafter's ring from a HELLO; use_device: map the device plane when one is offered (when it
        cannot be, the ring reads the file and `device_refused` says why; the verifier learns which from
        the REPLY). ValueError for a malformed HELLO or a path that is not a ring."""
        if len(payload) > MAX_HELLO:
            raise ValueError(f"HELLO of {len(payload)} bytes (at most {MAX_HELLO})")
        try:
            hello = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError("HELLO is not JSON") from None
        if not isinstance(hello, dict) or set(hello) != {"path", "device_plane"} or not isinstance(hello["path"], str):
            raise ValueError("HELLO must be {path, device_plane}")
        ring = cls.attach(hello["path"])
        if use_device and hello["device_plane"] is not None:
            try:
                handle = DevicePlaneHandle.from_json(hello["device_plane"])
                if handle.size != ring.size:
                    raise ValueError(f"device plane of {handle.size} bytes for a ring of {ring.size}")
                ring.device = DevicePlane.open(handle)
            except ValueError as err:  # not the drafter's failure: it reads the file instead
                ring.device_refused = str(err)
        return ring

    def fits(self, nbytes: int) -> bool:
        """A record of nbytes fits (at most half the ring: the records of one call never overwrite each other)."""
        return _HEADER.size + nbytes <= self.size // 2

    def record_bytes(self, nbytes: int) -> int:
        """The ring space one record of nbytes takes, alignment included."""
        return -(-(_HEADER.size + nbytes) // _ALIGN) * _ALIGN

    def write(self, data: torch.Tensor) -> tuple[int, int, int]:
        """Append one record of a tensor's bytes (any dtype and device; contiguous); (offset, nbytes, generation)."""
        flat = data.detach().contiguous().view(-1).view(torch.uint8)
        n = flat.numel()
        if not self.fits(n):
            raise ValueError(f"{n} bytes do not fit a feature ring of {self.size}")
        if self._pos + _HEADER.size + n > self.size:
            self._pos = 0
        self._generation += 1
        at = self._pos
        if self.device is not None:
            self.device.write(at + _HEADER.size, flat)
        else:
            self._bytes[at + _HEADER.size : at + _HEADER.size + n].copy_(flat)
        _HEADER.pack_into(self._map, at, self._generation, n)
        self._pos = at + self.record_bytes(n)
        return at, n, self._generation

    def read(self, offset: int, nbytes: int, generation: int) -> torch.Tensor:
        """A copy of the record at offset, uint8 [nbytes] (on the device plane's device, or the CPU);
        ValueError when the reference is out of bounds or stale."""
        if offset % _ALIGN or offset + _HEADER.size + nbytes > self.size:
            raise ValueError(f"feature reference [{offset}, +{nbytes}) outside the ring of {self.size} bytes")
        got_generation, got_nbytes = _HEADER.unpack_from(self._map, offset)
        if (got_generation, got_nbytes) != (generation, nbytes):
            raise ValueError(f"stale feature reference: record {got_generation} of {got_nbytes} bytes at {offset}, "
                             f"expected record {generation} of {nbytes}")  # fmt: skip
        start = offset + _HEADER.size
        if self.device is not None:
            out = self.device.read(start, nbytes)
        else:
            copy = bytearray(nbytes)
            copy[:] = memoryview(self._map)[start : start + nbytes]
            out = torch.frombuffer(copy, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        if _HEADER.unpack_from(self._map, offset)[0] != generation:  # overwritten while copied
            raise ValueError(f"feature record {generation} at {offset} was overwritten while read")
        return out

    def unlink(self) -> None:
        """Remove the file's name once both processes have it mapped: its memory then goes with the last
        mapping, so a verifier killed outright leaves nothing behind in /dev/shm."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def use_host(self) -> None:
        """Keep the data in the file from now on (the drafter did not map the device plane)."""
        self.device = None

    def close(self, unlink: bool = False) -> None:
        self._bytes = None
        self.device = None
        self._map.close()
        if unlink:
            self.unlink()
