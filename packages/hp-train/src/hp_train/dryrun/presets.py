"""Named topologies and devices the dry run knows, the model presets it shares with the
trainer, and the errors of bad names.

Model presets: :data:`MODEL_PRESETS` is :mod:`hp_train.presets`' table (the one the trainer's
``--model`` uses too): ``tiny``, ``small``, ``tiny-moe``, ``llama_8b``, ``moe_505b``.

Topology presets (:func:`topology_preset`): ``single_host[:N]``, ``cluster:HxR`` (hosts x ranks
per host), ``ascend_supernode[:K]`` (K supernodes of 384 cards = 768 dies each); the figures are
:class:`hp_layout.Topology`'s nominal ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_layout import Topology, TopologyError
from hp_train import presets
from hp_train.config import ConfigError
from hp_train.presets import MODEL_PRESETS, MOE_505B_PARAMS, ModelPreset

__all__ = [
    "DEVICE_PRESETS",
    "MODEL_PRESETS",
    "MOE_505B_PARAMS",
    "Device",
    "DryRunError",
    "ModelPreset",
    "device_for",
    "model_preset",
    "topology_preset",
]


class DryRunError(ConfigError):
    """A dry-run input that cannot work (the message names it and what would be right)."""


def model_preset(name: str) -> ModelPreset:
    """The model preset called ``name`` (:func:`hp_train.presets.model_preset`).

    Raises:
        DryRunError: no such preset (the message lists the known ones).
    """
    try:
        return presets.model_preset(name)
    except ConfigError as exc:
        raise DryRunError(str(exc)) from None


def _ints(text: str, sep: str, count: int, spec: str) -> tuple[int, ...]:
    parts = text.split(sep)
    if len(parts) != count or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise DryRunError(f"topology {spec!r}: expected {count} positive integer(s) after ':'")
    return tuple(int(p) for p in parts)


def topology_preset(spec: str) -> Topology:
    """The topology a preset string names.

    ``single_host`` (8 ranks) or ``single_host:N``; ``cluster:HxR`` (H hosts of R ranks);
    ``ascend_supernode`` (one 768-die supernode: tiers ``card`` of 2 and ``supernode`` of 768)
    or ``ascend_supernode:K`` (K supernodes joined by RDMA, a third tier ``cluster``).

    Raises:
        DryRunError: an unknown name or malformed sizes (the message lists the forms).
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
        raise DryRunError(f"topology {spec!r}: {exc}") from None
    raise DryRunError(f"unknown topology preset {spec!r}; known forms: {forms}")


@dataclass(frozen=True)
class Device:
    """Compute throughput of one rank.

    Attributes:
        name: a label.
        peak_flops: dense peak in FLOP/s at the compute precision.
        efficiency: achieved fraction of the peak on the model's matmuls (model FLOPs
            utilization); compute time is ``flops / (peak_flops * efficiency)``.
    """

    name: str
    peak_flops: float
    efficiency: float = 0.4

    def __post_init__(self) -> None:
        if not self.peak_flops > 0:
            raise DryRunError(f"device peak_flops must be > 0, got {self.peak_flops}")
        if not 0 < self.efficiency <= 1:
            raise DryRunError(f"device efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def flops(self) -> float:
        """Achieved FLOP/s."""
        return self.peak_flops * self.efficiency


DEVICE_PRESETS: dict[str, Device] = {
    # Nominal: an Ascend 910C card is ~752 TFLOP/s dense bf16 over its two dies.
    "ascend_910c_die": Device("ascend_910c_die", 376e12),
    # A generic current accelerator (bf16 dense).
    "accelerator": Device("accelerator", 400e12),
    # A CPU core pool, for the CPU/gloo test runs.
    "cpu": Device("cpu", 50e9),
}


def device_for(topology: Topology) -> Device:
    """The default device of a topology preset: an Ascend die for Ascend supernodes, else a
    generic accelerator."""
    if topology.name.startswith("ascend_supernode"):
        return DEVICE_PRESETS["ascend_910c_die"]
    return DEVICE_PRESETS["accelerator"]
