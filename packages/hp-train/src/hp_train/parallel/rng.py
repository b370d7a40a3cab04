"""Which random stream each rank's dropout draws from (``TrainConfig.dropout``).

Parameter init seeds torch's default generator with ``TrainConfig.seed`` on every rank, so that
every rank builds the same numbers as one device. Left there, every data-parallel rank would
then draw the same dropout masks for its different sequences: the masks of the global batch
would repeat once per data-parallel slice, and change with the data-parallel degree. After the
model is built, :func:`seed_dropout` therefore reseeds the default generator (the one
``torch.nn.functional.dropout`` draws from) with :func:`dropout_seed` of this rank's place:

* ranks that differ only in their tensor-parallel coordinate get the same seed: they hold the
  same replicated residual stream (hp-train's plan is not sequence parallel) and must zero the
  same elements of it, or the replicas would disagree;
* data-parallel ranks (``dp_replicate x dp_shard``, expert-parallel ranks included: they are
  carved from ``dp_shard x cp``), context-parallel ranks (which hold different columns of the same
  sequences) and pipeline stages (different blocks) get different seeds.

Data-parallel rank 0 of context-parallel rank 0 and stage 0 gets the seed one device gets, so a
tensor-parallel run draws the masks of the one-device run with the same seed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from hp_train.config.schema import TrainConfig

if TYPE_CHECKING:
    from hp_train.parallel.parallelize import Layout3D

__all__ = ["dropout_seed", "rng_states", "seed_dropout", "set_rng_states"]

# torch.manual_seed takes 64-bit seeds; 63 bits keep it a non-negative int64 everywhere.
_SEED_BITS = 63


def dropout_seed(seed: int, dp_rank: int, cp_rank: int = 0, pp_stage: int = 0) -> int:
    """The dropout seed of the rank at ``(dp_rank, cp_rank, pp_stage)`` of a run with ``seed``.

    A hash of the four numbers (SHA-256, 63 bits), not ``seed + dp_rank``: neighbouring
    seeds would otherwise share streams between ranks (seed 1 on rank 0 = seed 0 on rank 1),
    and no two places of one run nor two runs' seeds collide short of a hash collision. The
    tensor-parallel coordinate is deliberately not an argument: tensor-parallel peers get the
    same seed (module docstring).

    Raises:
        ValueError: an argument that is not an int (``seed`` may be negative; the rest are
            coordinates, >= 0).
    """
    given = {"seed": seed, "dp_rank": dp_rank, "cp_rank": cp_rank, "pp_stage": pp_stage}
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
        if name != "seed" and value < 0:
            raise ValueError(f"{name} is a coordinate and must be >= 0, got {value}")
    text = f"hp-train dropout seed={seed} dp={dp_rank} cp={cp_rank} pp={pp_stage}"
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - _SEED_BITS)


def seed_dropout(config: TrainConfig, layout: Layout3D, rank: int) -> int:
    """Reseed torch's default generators (CPU and every accelerator's, ``torch.manual_seed``)
    with :func:`dropout_seed` of global ``rank``'s place in ``layout``; return the seed.

    Call it on every rank after the model is built and initialized (init must draw the same
    numbers on every rank first) and before the first training step. Nothing else in a
    training step draws from the default generator, so from then on it is dropout's stream.
    """
    cp_rank = 0 if layout.cp_mesh is None else layout.cp_mesh.mesh.coordinate(rank)[0]
    stage = 0 if layout.pipeline_mesh is None else layout.pipeline_mesh.mesh.coordinate(rank)[0]
    seed = dropout_seed(config.seed, layout.dp_rank, cp_rank, stage)
    torch.manual_seed(seed)
    return seed


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random generators' states by device type: the CPU's, and ``device``'s
    when it is an accelerator (what a checkpoint or snapshot saves for dropout's masks)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        states[device.type] = torch.get_device_module(device.type).get_rng_state(device)
    return states


def set_rng_states(states: Mapping[str, torch.Tensor], device: torch.device) -> None:
    """Restore what :func:`rng_states` returned (``device``'s entry when there is one)."""
    torch.set_rng_state(states["cpu"])
    if device.type in states and device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(states[device.type], device)
