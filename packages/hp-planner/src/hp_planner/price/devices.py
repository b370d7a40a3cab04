"""Named topologies and devices the pricing knows, and the errors of bad names (the models
are the caller's: a trainer's presets, or any :class:`~hp_planner.price.model.PricedModel`).

Topology presets (:func:`topology_preset`): ``single_host[:N]``, ``cluster:HxR`` (hosts x ranks
per host), ``ascend_supernode[:K]`` (K supernodes of 384 cards = 768 dies each); the figures are
:class:`hp_layout.Topology`'s nominal ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_layout import Topology, TopologyError
from hp_planner.price.model import PricingError

__all__ = [
    "DEVICE_PRESETS",
    "TOPOLOGY_SOURCES",
    "Device",
    "device_for",
    "topology_preset",
    "topology_source",
]


def _ints(text: str, sep: str, count: int, spec: str) -> tuple[int, ...]:
    parts = text.split(sep)
    if len(parts) != count or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise PricingError(f"topology {spec!r}: expected {count} positive integer(s) after ':'")
    return tuple(int(p) for p in parts)


def topology_preset(spec: str) -> Topology:
    """The topology a preset string names.

    ``single_host`` (8 ranks) or ``single_host:N``; ``cluster:HxR`` (H hosts of R ranks);
    ``ascend_supernode`` (one 768-die supernode: tiers ``card`` of 2 and ``supernode`` of 768)
    or ``ascend_supernode:K`` (K supernodes joined by RDMA, a third tier ``cluster``).

    Raises:
        PricingError: an unknown name or malformed sizes (the message lists the forms).
    """
    name, _, arg = spec.partition(":")
    forms = "single_host[:N], cluster:HxR, ascend_supernode[:K]"
    try:
        if name == "single_host":
            return Topology.single_host(_ints(arg, "x", 1, spec)[0] if arg else 8)
        if name == "cluster":
            hosts, per_host = _ints(arg, "x", 2, spec)
            return Topology.two_tier_cluster(hosts, per_host)
        if name == "ascend_supernode":
            return Topology.ascend_supernode(_ints(arg, "x", 1, spec)[0] if arg else 1)
    except TopologyError as exc:
        raise PricingError(f"topology {spec!r}: {exc}") from None
    raise PricingError(f"unknown topology preset {spec!r}; known forms: {forms}")


@dataclass(frozen=True)
class Device:
    """One rank's compute throughput, memory and host link.

    Attributes:
        name: a label.
        peak_flops: dense peak in FLOP/s at the compute precision.
        efficiency: achieved fraction of the peak on the model's matmuls (model FLOPs
            utilization); compute time is ``flops / (peak_flops * efficiency)``.
        memory_bytes: device memory per rank (the search's default limit).
        host_bandwidth: bytes per second between the rank and host memory, each way (what
            offload moves over).
        fp8_peak_flops: dense FP8 peak, or None where the device has no FP8 matmul (FP8
            linears are then emulated at the compute precision's speed).
        memory_bandwidth: device memory bytes per second (what copy kernels run at).
        source: where the figures come from.
    """

    name: str
    peak_flops: float
    efficiency: float = 0.4
    memory_bytes: int = 64 * 2**30
    host_bandwidth: float = 32e9
    fp8_peak_flops: float | None = None
    memory_bandwidth: float = 1.6e12
    source: str = "nominal"

    def __post_init__(self) -> None:
        if not self.peak_flops > 0:
            raise PricingError(f"device peak_flops must be > 0, got {self.peak_flops}")
        if not 0 < self.efficiency <= 1:
            raise PricingError(f"device efficiency must be in (0, 1], got {self.efficiency}")
        if not self.memory_bytes > 0 or not self.host_bandwidth > 0:
            raise PricingError("device memory_bytes and host_bandwidth must be > 0")

    @property
    def flops(self) -> float:
        """Achieved FLOP/s."""
        return self.peak_flops * self.efficiency

    @property
    def fp8_speedup(self) -> float:
        """How much faster an FP8 matmul runs than one at the compute precision (1 where FP8
        is emulated)."""
        return 1.0 if self.fp8_peak_flops is None else self.fp8_peak_flops / self.peak_flops


DEVICE_PRESETS: dict[str, Device] = {
    "ascend_910c_die": Device(
        "ascend_910c_die",
        376e12,
        memory_bytes=64 * 2**30,
        host_bandwidth=32e9,
        memory_bandwidth=1.6e12,
        source="one die of an Ascend 910C card: Huawei's CloudMatrix384 description ('Serving "
        "Large Language Models on Huawei CloudMatrix384', 2025) gives ~752 TFLOP/s dense BF16 "
        "and 128 GB of HBM at ~3.2 TB/s per card of two dies, so 376 TFLOP/s, 64 GiB and "
        "~1.6 TB/s per die; no FP8 "
        "matmul (FP8 is emulated); host link: the card's PCIe 5.0 x16 (~64 GB/s each way) "
        "shared by its two dies; efficiency 0.4 is an assumed MFU, not a published figure",
    ),
    "accelerator": Device(
        "accelerator",
        400e12,
        memory_bytes=80 * 2**30,
        host_bandwidth=25e9,
        fp8_peak_flops=800e12,
        memory_bandwidth=3e12,
        source="a generic current accelerator: round figures (400 TFLOP/s dense BF16, twice "
        "that in FP8, 80 GiB at 3 TB/s, PCIe ~25 GB/s each way), no specific product",
    ),
    "cpu": Device(
        "cpu",
        50e9,
        memory_bytes=16 * 2**30,
        host_bandwidth=10e9,
        memory_bandwidth=20e9,
        source="a CPU core pool, for the CPU/gloo test runs (order of magnitude only)",
    ),
}


TOPOLOGY_SOURCES: dict[str, str] = {
    "ascend_supernode": "hp_layout.Topology.ascend_supernode: per-die figures after Huawei's "
    "CloudMatrix384 description ('Serving Large Language Models on Huawei CloudMatrix384', "
    "2025): the two dies of a card share an on-package link (~540 GB/s, ~0.5 us), the Unified "
    "Bus joins the 384 cards (~392 GB/s per card one way, ~196 GB/s per die, ~2 us), RDMA "
    "between supernodes (~400 Gb/s per card, ~25 GB/s per die, ~10 us)",
    "cluster": "hp_layout.Topology.two_tier_cluster: round figures, 100 GB/s and 5 us inside a "
    "host, a 100 Gb/s NIC per rank (12.5 GB/s, 20 us) across hosts",
    "single_host": "hp_layout.Topology.single_host: round figures, 100 GB/s and 5 us",
}
"""Where each topology preset's link figures come from, by preset name."""


def topology_source(spec: str) -> str:
    """Where the figures of topology preset ``spec`` come from."""
    return TOPOLOGY_SOURCES.get(spec.partition(":")[0], "custom")


def device_for(topology: Topology) -> Device:
    """The default device of a topology preset: an Ascend die for Ascend supernodes, else a
    generic accelerator."""
    if topology.name.startswith("ascend_supernode"):
        return DEVICE_PRESETS["ascend_910c_die"]
    return DEVICE_PRESETS["accelerator"]
