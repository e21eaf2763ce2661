"""The devices a roofline is drawn for (`ddtree bench step --device-model NAME`): a small typed table of
what bounds a kernel (HBM bandwidth, tensor-core and ALU throughput, SMs) and what bounds an all-reduce
(the interconnect), from the vendors' datasheets (dense figures, no sparsity).

Assumptions, stated once (tools/roofline/roofline.py uses them):
- a grid draws bandwidth in proportion to its CTAs until one CTA per SM (`saturating_ctas`): a 12-CTA grid
  on 132 SMs streams at 12/132 of HBM, whatever its per-CTA pipelining (an optimistic cap for a CTA whose
  loads in flight are few, a pessimistic one where one SM could pull more than its share);
- throughput (tensor core or ALU) scales the same way with CTAs;
- `alu_tops`: scalar instructions per second (FP32 lanes x clock: the fp32 FMA TFLOPS / 2); integer and
  conversion instructions are counted at that rate;
- INT4 has no tensor-core path on these parts (Hopper has none; Blackwell's 4-bit MMA is FP4): INT4 weights
  are dequantized and multiplied at the bf16 rate;
- an all-reduce of S bytes over n ranks costs `latency_us + 2 (n - 1) / n · S / bus_gbps` (NCCL's ring /
  LL figure of merit; the latency is one small all-reduce captured in a graph, a modeled figure).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Interconnect:
    name: str  # "NVLink 4", "PCIe 5 x16"
    bus_gbps: float  # achievable all-reduce bus bandwidth per GPU, GB/s (assumed)
    latency_us: float  # one small all-reduce, graph-captured (assumed)

    def all_reduce_us(self, nbytes: int, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return self.latency_us + 2 * (ranks - 1) / ranks * nbytes / (self.bus_gbps * 1e3)


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    name: str
    hbm_gbps: float  # DRAM bandwidth, GB/s
    bf16_tflops: float  # dense tensor-core, fp32 accumulate
    fp8_tflops: float
    int4_tops: float | None  # None: no INT4 tensor-core path (dequantized to bf16)
    fp32_tflops: float  # non-tensor FMA (2 flops per FMA)
    sms: int
    memory_gb: float
    interconnect: Interconnect
    arch: int  # compute capability as 90 = sm_90: the kernels' wrappers choose their tiles for it
    smem_per_block: int  # bytes one block may take (kernels/shared_memory.SMEM_PER_BLOCK)

    @property
    def alu_tops(self) -> float:
        """Scalar instructions per second, 1e12 (one per FP32 lane per clock)."""
        return self.fp32_tflops / 2

    def math_tflops(self, kind: str) -> float:
        """The peak of a kernel's math kind: bf16 / fp16 / fp8 / int4 (tensor cores), fp32 (FMA units)."""
        int4 = self.int4_tops if self.int4_tops is not None else self.bf16_tflops
        peaks = {"bf16": self.bf16_tflops, "fp16": self.bf16_tflops, "fp8": self.fp8_tflops, "int4": int4,
                 "fp32": self.fp32_tflops}  # fmt: skip
        if kind not in peaks:
            raise ValueError(f"unknown math kind {kind!r}")
        return peaks[kind]

    def saturating_ctas(self) -> int:
        """The CTAs a grid needs to draw the whole device (one per SM, see the module docstring)."""
        return self.sms

    def fill(self, ctas: int) -> float:
        """The fraction of the device's bandwidth and throughput a grid of `ctas` CTAs draws."""
        return min(1.0, max(ctas, 1) / self.saturating_ctas())


NVLINK4 = Interconnect("NVLink 4 (NVSwitch)", bus_gbps=360.0, latency_us=8.0)
NVLINK5 = Interconnect("NVLink 5 (NVSwitch)", bus_gbps=720.0, latency_us=8.0)
_SM90, _SM120 = 227 * 1024, 99 * 1024  # shared memory per block: sm_90 / sm_100, sm_120
PCIE5 = Interconnect("PCIe 5 x16, no NVLink", bus_gbps=25.0, latency_us=25.0)

DEVICES: dict[str, DeviceModel] = {
    "h100": DeviceModel("NVIDIA H100 SXM", 3350.0, 989.4, 1978.9, None, 66.9, 132, 80.0, NVLINK4, 90, _SM90),
    "h200": DeviceModel("NVIDIA H200 SXM", 4800.0, 989.4, 1978.9, None, 66.9, 132, 141.0, NVLINK4, 90, _SM90),
    "b200": DeviceModel("NVIDIA B200", 8000.0, 2250.0, 4500.0, None, 75.0, 148, 180.0, NVLINK5, 100, _SM90),
    "rtx-pro-6000": DeviceModel(
        "NVIDIA RTX PRO 6000 Blackwell Workstation", 1792.0, 503.8, 1007.6, None, 125.0, 188, 96.0, PCIE5, 120, _SM120
    ),
}
DEVICE_NAMES = tuple(DEVICES)


def device_model(name: str) -> DeviceModel:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device model {name!r}: one of {', '.join(DEVICE_NAMES)}") from None


def model_of_gpu(gpu_name: str) -> DeviceModel | None:
    """The table's entry for a CUDA device name (torch.cuda.get_device_name), or None."""
    name = gpu_name.lower()
    for key, probe in (("h200", "h200"), ("h100", "h100"), ("b200", "b200"), ("rtx-pro-6000", "rtx pro 6000")):
        if probe in name:
            return DEVICES[key]
    return None
