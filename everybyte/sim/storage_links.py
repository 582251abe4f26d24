"""What the storage tiers below host memory cost: a worker's local NVMe drives (G3, the real engine's
`--kv-tiers disk:PATH:SIZE` tier, below G2 in the spill chain) and the shared storage every worker
of the fleet reaches over the network (G4, `--kv-tiers cold:PATH:SIZE`: a shared file system or
object store; the real TierSet keeps it at the end of each worker's spill chain, so what one worker
spills there any worker can load). Figures with their sources; a judgment says so in its source.
Node figures are per GPU here (drives per GPU), as the hardware catalog's are."""
from __future__ import annotations

from typing import Any

from everybyte.formats.sizes import parse_size
from everybyte.sim.cost_model import CostModel, TierLink

Figures = dict[str, tuple[float, str]]

_DGXC = "https://github.com/NVIDIA/dgxc-benchmarking (README, reference architectures: "
_DGXC_H100 = _DGXC + "DGX H100 'Local Storage: 2x 1.92 TB NVMe M.2, 8x 3.84 TB NVMe U.2' for 8 GPUs)"
_DGXC_B300 = _DGXC + "DGX B300 'Local Storage: 2x 1.9 TB NVMe M.2, 8x 3.84 TB NVMe E1.S' for 8 GPUs)"
_OCI = "https://docs.oracle.com/en-us/iaas/Content/Compute/References/computeshapes.htm ("
_OCI_H200 = _OCI + "BM.GPU.H200.8: 8x H200, 8x 3.84 TB NVMe; as a public research note quotes it, not read here)"
_OCI_GB200 = _OCI + ("BM.GPU.GB200.4, the 4 GPUs of a GB200 NVL72 compute tray: 4x 7.68 TB NVMe; as a public research "
                     "note quotes it, not read here)")
_MICRON = ("https://www.storagereview.com/review/micron-9550-max-review-balanced-performance-for-ai-db-and-analytics "
           "(Micron 9550, PCIe Gen5 x4 NVMe: 14,000 MB/s sequential read, 10,000 MB/s sequential write, typical "
           "read latency 60 us)")
_DRIVE_JUDGMENT = ("; the node sources name no drive model: this Gen5 datasheet is taken for every node's drives "
                   "(a judgment; a Gen4 U.2 drive reads about half as fast)")

NVME_DRIVE: Figures = {
    "read_bytes_per_s": (14e9, _MICRON + _DRIVE_JUDGMENT),
    "write_bytes_per_s": (10e9, _MICRON + _DRIVE_JUDGMENT),
    "latency_s": (60e-6, _MICRON + _DRIVE_JUDGMENT),
}
NVME_KEYS = {"drives_per_gpu": "NVMe data drives per GPU (drives per node / GPUs per node)",
             "drive_bytes": "capacity of one NVMe data drive (bytes)"}
LOCAL_NVME: dict[str, Figures] = {
    "H200": {"drives_per_gpu": (8 / 8, _OCI_H200 + "; the same as " + _DGXC_H100),
             "drive_bytes": (3.84e12, _OCI_H200 + "; the same as " + _DGXC_H100)},
    "B200": {"drives_per_gpu": (8 / 8, _DGXC_B300 + "; DGX B300's drives taken for the B200 node (a judgment)"),
             "drive_bytes": (3.84e12, _DGXC_B300 + "; DGX B300's drives taken for the B200 node (a judgment)")},
    "GB200-NVL72": {"drives_per_gpu": (4 / 4, _OCI_GB200), "drive_bytes": (7.68e12, _OCI_GB200)},
    "GB300-NVL72": {k: (v, _OCI_GB200 + "; the GB200 tray's drives taken for GB300 (a judgment: "
                           "https://docs.nvidia.com/dgx/dgxgb200-user-guide/storage.html gives E1.S drives in RAID 0 "
                           "per compute tray, no count)") for k, v in (("drives_per_gpu", 4 / 4), ("drive_bytes", 7.68e12))},
}

_SUPERPOD = ("https://cidian.kuaisou.com/dgx-superpod-reference-architecture-dgx-h100 (NVIDIA DGX SuperPOD H100 RA: "
             "'Using the storage fabric on the DGX SuperPOD, a GDS-enabled application should be able to read data "
             "at over 40 GBps' per DGX node of 8 GPUs)")
_S3X = ("https://docs.aws.amazon.com/AmazonS3/latest/userguide/s3-express-performance.html (S3 Express One Zone: "
        "'consistent single-digit millisecond first-byte read and write request latencies', up to 10x faster than "
        "S3 Standard)")
SHARED_STORAGE: Figures = {
    "capacity_bytes": (10e15, "no source gives a fleet's shared storage capacity: 10 PB taken (a judgment: ten "
                              "times the pod flash tier's petabyte)"),
    "latency_s": (5e-3, _S3X + "; 5 ms taken, the middle of the single digits (a judgment; a parallel file system "
                               "over RDMA answers sooner)"),
}
SHARED_KEYS = {"shared_storage_bytes_per_s": "shared storage read bandwidth per GPU"}
_PER_GPU = 40e9 / 8
SHARED_STORAGE_BANDWIDTH: dict[str, tuple[float, str]] = {
    "H200": (_PER_GPU, _SUPERPOD + " / 8 GPUs (DGX H200 sits in the same SuperPOD design)"),
    **{name: (_PER_GPU, _SUPERPOD + f" / 8 GPUs, taken for {name} (a judgment: the storage system, not the node, "
                                    "sets it; no source gives one for this generation)")
       for name in ("B200", "GB200-NVL72", "GB300-NVL72")},
}


def tier_bytes(flag: str, value: str, catalog_bytes: int) -> int:
    """A tier flag's size: the catalog's when given without a value ("catalog"), else BYTES."""
    if value == "catalog":
        return catalog_bytes
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(f"{flag} {value!r}: {e}") from None


def _missing(hw_name: str, tier: str, keys: dict[str, str], have: list[str]) -> ValueError:
    wanted = "; ".join(f"{k} ({v})" for k, v in keys.items())
    return ValueError(f"hardware {hw_name!r} has no sourced {tier} figures: missing {wanted}; hardware that has "
                      f"them: {', '.join(have)}")


def local_nvme(cost: CostModel) -> tuple[TierLink, int]:
    """A worker's NVMe drives: the load link (drives x sequential read, the drive's latency) and the
    capacity of its drives (the default --disk-tier)."""
    figures = LOCAL_NVME.get(cost.hw.name)
    if figures is None or any(k not in figures for k in NVME_KEYS):
        raise _missing(cost.hw.name, "local NVMe (G3)", {k: v for k, v in NVME_KEYS.items()
                                                          if k not in (figures or {})}, list(LOCAL_NVME))
    drives = figures["drives_per_gpu"][0] * cost.gpus
    link = TierLink(drives * NVME_DRIVE["read_bytes_per_s"][0], NVME_DRIVE["latency_s"][0],
                    drives * NVME_DRIVE["write_bytes_per_s"][0])
    return link, int(drives * figures["drive_bytes"][0])


def shared_storage_link(cost: CostModel) -> TierLink:
    """The shared storage as one worker reads it: the per-GPU figure x the worker's GPUs."""
    bandwidth = SHARED_STORAGE_BANDWIDTH.get(cost.hw.name)
    if bandwidth is None:
        raise _missing(cost.hw.name, "shared storage (G4)", SHARED_KEYS, list(SHARED_STORAGE_BANDWIDTH))
    return TierLink(bandwidth[0] * cost.gpus, SHARED_STORAGE["latency_s"][0])


def _sourced(figures: Figures) -> dict[str, Any]:
    return {k: {"value": v, "source": s} for k, (v, s) in figures.items()}


def describe_nvme(hw_name: str, capacity_bytes: int, link: TierLink) -> dict[str, Any]:
    return {"capacity_bytes_per_worker": capacity_bytes, "load_bytes_per_s_per_worker": link.bytes_per_s,
            "latency_s": link.latency_s, **describe_catalog(hw_name)["G3_local_nvme"],
            "bandwidth": "drives per GPU x GPUs per worker x the drive's sequential read; writes (spills) "
                         "x its sequential write, on a lane of their own (sim/link_lanes)"}


def describe_shared(hw_name: str, capacity_bytes: int, link: TierLink) -> dict[str, Any]:
    return {"capacity_bytes": capacity_bytes, "load_bytes_per_s_per_worker": link.bytes_per_s,
            "latency_s": link.latency_s, "catalog": describe_catalog(hw_name)["G4_shared_storage"],
            "contention": "each worker's reads (and writes) queue on its own link at this figure; across "
                          "workers only under --shared-storage-bandwidth (no source gives the store's aggregate)"}


def describe_catalog(hw_name: str) -> dict[str, Any]:
    """The storage tier figures the catalog has for this hardware (`everybyte sim hardware`)."""
    out: dict[str, Any] = {}
    if hw_name in LOCAL_NVME:
        out["G3_local_nvme"] = {"node": _sourced(LOCAL_NVME[hw_name]), "drive": _sourced(NVME_DRIVE)}
    if hw_name in SHARED_STORAGE_BANDWIDTH:
        value, source = SHARED_STORAGE_BANDWIDTH[hw_name]
        out["G4_shared_storage"] = {**_sourced(SHARED_STORAGE), "bandwidth_per_gpu": {"value": value, "source": source}}
    return out
