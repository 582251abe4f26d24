"""The hardware catalog: per-GPU figures with a source for every number. A figure that could not
be sourced is absent (the cost model then says which one it needs), never guessed.

Figures are per GPU. FLOP/s are dense (no 2:4 sparsity): where a source quotes the with-sparsity
figure, the entry halves it and says so. `cpu-this-machine` is measured when first asked for
(a numpy matmul and copy, see measure_cpu), not recorded.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import lru_cache

from everybyte.native.host_memory import total_memory_bytes

Figures = dict[str, tuple[float, str]]

KEYS = {
    "hbm_bytes": "device memory per GPU (bytes)",
    "hbm_bytes_per_s": "device memory bandwidth per GPU",
    "flops_fp16": "dense FP16/BF16 tensor FLOP/s per GPU",
    "flops_fp8": "dense FP8 tensor FLOP/s per GPU",
    "flops_nvfp4": "dense NVFP4 tensor FLOP/s per GPU",
    "flops_fp32": "dense FP32 FLOP/s (the CPU's)",
    "nvlink_bytes_per_s": "NVLink bandwidth per GPU (both directions)",
    "nvlink_domain_gpus": "GPUs in one NVLink domain",
    "nic_bytes_per_s": "scale-out network (RDMA NIC) bandwidth per GPU, one direction",
    "host_bytes": "host memory per GPU (bytes)",
    "host_bytes_per_s": "host <-> GPU bandwidth per GPU (C2C or PCIe, both directions)",
    "gpu_power_w": "power per GPU (TDP, W)",
    "rack_power_w": "power per rack (W)",
}

_H200 = "https://lzwjava.github.io/nvidia-h200-gpu-specs-en (NVIDIA H200 SXM table)"
_H200_NODE = ("https://ai-hpc.github.io/ai-hardware-engineer-roadmap/ (8x H200 SXM5 system snapshot)")
_H200_PCIE = "https://www.saulelectric.com/nvidia-h200.html (H200 interfaces: PCIe Gen5 128 GB/s)"
_B200 = "https://glennklockwood.com/garden/processors/B200 (HGX B200 at 1,000 W, dense 'Matrix' column)"
_B200_MEM = "https://docs.vultr.com/inference-cookbook/cuda/getting-started/hardware-overview (HGX B200, nvidia-smi)"
_GB200 = "https://glennklockwood.com/garden/processors/B200 (GB200 variant of B200 at 1,200 W, dense 'Matrix' column)"
_GB200_RACK = "https://aiwiki.ai/wiki/nvidia_gb200_nvl72 (NVIDIA's GB200 NVL72 figures: 13.4 TB HBM, 130 TB/s NVLink)"
_GB300 = "https://verda.com/blog/gb300-nvl72-architecture (GB300 per-GPU table, dense)"
_GB300_RACK = "https://glennklockwood.com/garden/processors/B300 (GB300 NVL72 as advertised: 20 TB HBM at 576 TB/s)"
_RUBIN = "https://mirrorfrog.com/en/blog/nvidia-vera-rubin-platform-6-chips-deep-dive (Rubin per-GPU table)"
_RUBIN_RACK = ("https://jp.imgtag.co.kr/?p=929391 (Vera Rubin NVL72: NVFP4 inference 3.6 EF = 50 PF per GPU, "
               "HBM4 20.7 TB + LPDDR5X 54 TB, NVLink 6 3.6 TB/s per GPU)")
_VERA_C2C = "https://megaobzor.com/NVIDIA-predstavila-novii-superkomputer-dlja-II.html (Vera NVLink-C2C 1.8 TB/s)"
_RUBIN_FP8 = ("https://megaobzor.com/NVIDIA-predstavila-novii-superkomputer-dlja-II.html (Vera Rubin NVL144, i.e. "
              "72 two-die GPUs: 1.2 EF FP8 training per rack); / 72 GPUs")
_RUBIN_POWER = ("https://regantih.github.io/reports-lab/sand-to-superintelligence/chapters/14-nvl72-drills.tsv "
                "(VR NVL72 rack 190-230 kW, Max Q to Max P; the low end here; "
                "https://www.techstories.co/what-it-takes-to-support-nvidias-vera-rubin-gpu says 120-130 kW)")
_H200_NIC = ("https://www.besthub.dev/articles/jensen-huang-s-china-visit-could-it-revive-gpu-prospects-inside-nvidia-s-"
             "dgx-h200-cluster-design-5fc4a3dfa57c (DGX H200 compute network: 4 dual-port OSFP at NDR 400 = 8 x "
             "400 Gb/s, one per GPU)")
_B200_NIC = ("https://rillor.com/insights/connectx-7-vs-connectx-8-and-nvlink5 (HGX B200: eight ConnectX-7 at "
             "400 Gb/s)")
_GB300_NIC = ("https://docs.nvidia.com/enterprise-reference-architectures/nvl72-ai-factory/latest/components.html "
              "(GB300 compute tray: 4 GPUs, 4 ConnectX-8) and https://cloudnews.tech/nvidia-connectx-8-supernic-the-"
              "new-generation-of-pcie-gen6-nics-at-800g-for-the-ai-era (ConnectX-8: 800 Gb/s)")
_GB300_C2C = ("https://grokipedia.com/page/NVIDIA_GB300 (Grace joined to the Blackwell Ultra GPUs by a 900 GB/s "
              "NVLink-C2C); one Grace serves two GPUs: halved per GPU")
_RUBIN_NIC = ("https://wheelersnetwork.com ('Decoding Nvidia's Rubin Networking Math': each Rubin GPU has a pair "
              "of 800G ConnectX-9 NICs, 1.6 Tb/s)")


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    figures: Figures = field(default_factory=dict)

    def get(self, key: str) -> float | None:
        f = self.figures.get(key)
        return None if f is None else f[0]

    def need(self, key: str) -> float:
        v = self.get(key)
        if v is None:
            have = ", ".join(sorted(self.figures))
            raise ValueError(f"hardware {self.name!r} has no sourced figure for {key} ({KEYS.get(key, key)}); "
                             f"it has: {have}")
        return v

    def flops(self, fmt: str) -> tuple[float, str]:
        """Dense FLOP/s for computing in `fmt` and the format whose figure it is: a format the
        hardware has no figure for runs at the next wider one it has (NVFP4 weights on Hopper
        compute as FP8)."""
        order = ("nvfp4", "fp8", "fp16", "fp32")
        start = order.index(fmt if fmt in order else "fp16")
        for f in order[start:]:
            if (v := self.get(f"flops_{f}")) is not None:
                return v, f
        return self.need(f"flops_{fmt}"), fmt

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "description": self.description,
                "figures": {k: {"value": v, "source": s} for k, (v, s) in self.figures.items()}}


def _half(value: float, source: str) -> tuple[float, str]:
    return value / 2, source + "; halved: the source quotes it with 2:4 sparsity"


CATALOG: dict[str, Hardware] = {h.name: h for h in (
    Hardware("H200", "NVIDIA H200 SXM (HGX/DGX H200: 8 GPUs on NVLink)", {
        "hbm_bytes": (141e9, _H200), "hbm_bytes_per_s": (4.8e12, _H200),
        "flops_fp8": _half(3958e12, _H200), "flops_fp16": _half(3958e12 / 2, _H200 + " (BF16 1,979 TFLOPS: "
                                                                       + _H200_NODE + ")"),
        "nvlink_bytes_per_s": (900e9, _H200), "nvlink_domain_gpus": (8, _H200_NODE),
        "host_bytes_per_s": (128e9, _H200_PCIE), "gpu_power_w": (700, _H200), "nic_bytes_per_s": (400e9 / 8, _H200_NIC)}),
    Hardware("B200", "NVIDIA HGX B200 (8 GPUs on NVLink 5)", {
        "hbm_bytes": (179e9, _B200_MEM), "hbm_bytes_per_s": (8e12, _B200_MEM),
        "flops_fp16": (2250e12, _B200), "flops_fp8": (4500e12, _B200), "flops_nvfp4": (9000e12, _B200),
        "nvlink_bytes_per_s": (1.8e12, _B200 + " (2x 900 GB/s NVLink 5)"), "nvlink_domain_gpus": (8, _B200_MEM),
        "gpu_power_w": (1000, _B200), "nic_bytes_per_s": (400e9 / 8, _B200_NIC)}),
    Hardware("GB200-NVL72", "NVIDIA GB200 NVL72 rack (72 B200 GPUs, 36 Grace CPUs, one NVLink domain)", {
        "hbm_bytes": (13.4e12 / 72, _GB200_RACK + "; / 72 GPUs"), "hbm_bytes_per_s": (8e12, _B200),
        "flops_fp16": (2500e12, _GB200), "flops_fp8": (5000e12, _GB200), "flops_nvfp4": (10000e12, _GB200),
        "nvlink_bytes_per_s": (1.8e12, _GB200_RACK + " (1.8 TB/s per GPU)"),
        "nvlink_domain_gpus": (72, _GB200_RACK), "gpu_power_w": (1200, _GB200)}),
    Hardware("GB300-NVL72", "NVIDIA GB300 NVL72 rack (72 Blackwell Ultra GPUs, 36 Grace CPUs)", {
        "hbm_bytes": (279e9, _GB300), "hbm_bytes_per_s": (576e12 / 72, _GB300_RACK + "; / 72 GPUs"),
        "flops_fp16": (2.5e15, _GB300), "flops_fp8": (5e15, _GB300), "flops_nvfp4": (15e15, _GB300),
        "nvlink_bytes_per_s": (1.8e12, _GB300 + " (fifth-generation NVLink 1.8 TB/s)"),
        "nvlink_domain_gpus": (72, _GB300), "gpu_power_w": (1400, _GB300), "nic_bytes_per_s": (800e9 / 8, _GB300_NIC),
        "host_bytes_per_s": (900e9 / 2, _GB300_C2C)}),
    Hardware("VR-NVL72", "NVIDIA Vera Rubin NVL72 rack (72 Rubin GPUs, 36 Vera CPUs) -- preliminary figures", {
        "hbm_bytes": (288e9, _RUBIN), "hbm_bytes_per_s": (22e12, _RUBIN),
        "flops_nvfp4": (50e15, _RUBIN_RACK + "; NVIDIA's 'NVFP4 inference' figure, which " + _RUBIN
                        + " reads as with sparsity: not halved here, an open assumption"),
        "flops_fp8": (1.2e18 / 72, _RUBIN_FP8), "rack_power_w": (190e3, _RUBIN_POWER),
        "nvlink_bytes_per_s": (3.6e12, _RUBIN_RACK), "nvlink_domain_gpus": (72, _RUBIN_RACK),
        "nic_bytes_per_s": (1.6e12 / 8, _RUBIN_NIC),
        "host_bytes": (54e12 / 72, _RUBIN_RACK + "; LPDDR5X / 72 GPUs"),
        "host_bytes_per_s": (1.8e12 / 2, _VERA_C2C + "; one Vera serves two GPUs: halved per GPU")}),
)}
ALIASES = {"h200": "H200", "h200-nvl8": "H200", "b200": "B200", "gb200": "GB200-NVL72", "gb200-nvl72": "GB200-NVL72",
           "gb300": "GB300-NVL72", "gb300-nvl72": "GB300-NVL72", "vera-rubin": "VR-NVL72", "vr-nvl72": "VR-NVL72",
           "rubin": "VR-NVL72", "vera-rubin-nvl72": "VR-NVL72"}
CPU = "cpu-this-machine"


def names() -> list[str]:
    return [*CATALOG, CPU]


def get_hardware(name: str) -> Hardware:
    if name == CPU:
        return measure_cpu()
    key = name if name in CATALOG else ALIASES.get(name.lower())
    if key is None:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(names())}")
    return CATALOG[key]


@lru_cache(maxsize=1)
def measure_cpu(seconds: float = 0.2) -> Hardware:
    """This machine's CPU, measured now: FP32 matmul FLOP/s and memory copy bandwidth (numpy,
    the best of a few runs) and MemTotal. The engine computes in fp32 on CPU, so every format
    runs at the FP32 figure."""
    import numpy as np
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    n = 256
    a, b = np.ones((n, n), np.float32), np.ones((n, n), np.float32)
    best, t_end = float("inf"), time.perf_counter() + seconds / 2
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    flops = 2 * n ** 3 / best
    src, dst = np.ones(8 << 20, np.uint8), np.empty(8 << 20, np.uint8)
    best_copy, t_end = float("inf"), time.perf_counter() + seconds / 2
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best_copy = min(best_copy, time.perf_counter() - t0)
    bw = 2 * src.nbytes / best_copy                   # read + write
    how = f"measured at {when} on this machine ({os.cpu_count()} CPUs; threads as numpy uses them)"
    figures: Figures = {"flops_fp32": (flops, f"{how}: best {n}x{n} fp32 matmul"),
                        "hbm_bytes_per_s": (bw, f"{how}: best 8 MiB copy, read + write bytes"),
                        "host_bytes_per_s": (bw, f"{how}: host tier = the same memory, same copy")}
    if (total := total_memory_bytes()) is not None:
        figures["hbm_bytes"] = (float(total), f"{how}: /proc/meminfo MemTotal")
    return Hardware(CPU, "this machine's CPU as the device (memory = RAM)", figures)
