"""What moving KV between the workers of a pod costs: the disaggregated prefill's transfer (the
`remote` level: NVLink when both workers sit in one NVLink domain, the scale-out network
otherwise) and the pod flash tier (G3.5, a CMX/ICMS-like context store shared by every worker of
the pod, reached over the network). Figures with their sources; what no source gives is said."""
from __future__ import annotations

from typing import Any

from everybyte.sim.cost_model import CostModel, TierLink

_ICMS = ("https://developer.nvidia.com/blog/introducing-nvidia-bluefield-4-powered-inference-context-memory-storage-"
         "platform-for-the-next-frontier-of-ai (ICMS: a pod-level KV tier reached over Spectrum-X RDMA)")
POD_FLASH: dict[str, tuple[float, str]] = {
    "capacity_bytes": (1e15, "https://aicrier.com/post/singc2sons44nwgm5t60 ('a dedicated petabyte-scale KV cache "
                             "tier'): 1 PB per pod taken as the figure"),
    "latency_s": (30e-6, "https://www.datacore.com/blog/breaking-storage-bottlenecks-with-nvme-of (NVMe-oF: 20-30 "
                         "us over a fabric; the upper end)"),
}
POD_FLASH_BANDWIDTH = ("the GPU's scale-out NIC (nic_bytes_per_s) x GPUs per worker: " + _ICMS
                       + "; the flash side's own bandwidth is not sourced and taken as no tighter. Each worker's reads and "
                       "writes queue on its own NIC lanes; the pod's aggregate caps them all only under "
                       "--pod-flash-bandwidth")


def remote_link(cost: CostModel, workers: int) -> tuple[TierLink, str]:
    """A prefill worker's KV to a decode worker: half the NVLink figure per GPU (one direction) when
    the fleet fits one NVLink domain, else the NIC per GPU; every GPU of the worker moves its share."""
    hw, g = cost.hw, cost.gpus
    domain = hw.get("nvlink_domain_gpus")
    if domain is not None and hw.get("nvlink_bytes_per_s") is not None and workers * g <= domain:
        return TierLink(hw.need("nvlink_bytes_per_s") / 2 * g), f"NVLink: {workers} x {g} GPUs within a domain of {domain:g}"
    nic = hw.get("nic_bytes_per_s")
    if nic is None:
        raise ValueError(f"hardware {hw.name!r}: {workers} workers of {g} GPUs exceed its NVLink domain "
                         f"({domain or 'none'}) and the catalog has no scale-out network figure (nic_bytes_per_s)")
    return TierLink(nic * g), f"network: {workers} x {g} GPUs exceed the NVLink domain of {domain or 'none'}"


def pod_flash_link(cost: CostModel) -> TierLink:
    nic = cost.hw.get("nic_bytes_per_s")
    if nic is None:
        raise ValueError(f"hardware {cost.hw.name!r} has no scale-out network figure (nic_bytes_per_s): the pod "
                         "flash tier is reached over it")
    return TierLink(nic * cost.gpus, POD_FLASH["latency_s"][0])


def describe() -> dict[str, Any]:
    return {"pod_flash": {**{k: {"value": v, "source": s} for k, (v, s) in POD_FLASH.items()},
                          "bandwidth": POD_FLASH_BANDWIDTH}}
