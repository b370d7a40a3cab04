"""Which techniques compose: the pairs of options the main job refuses, as data.

Every technique of a run is an option (``--ep``, ``--cp``, ``--ac``, ``--fp8``, ...). Any two
of them compose unless a :class:`Refusal` below names the pair; :func:`check_combination`
raises the first that applies, from the configuration alone (before any process group), with
both options and the reason. The hp-train README's table of refused pairs is
:func:`combination_table` (a test keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hp_planner import JobDims
from hp_train.config.schema import ConfigError, ModelConfig, TrainConfig

__all__ = ["REFUSALS", "Refusal", "check_combination", "combination_table"]

Applies = Callable[[ModelConfig, JobDims, TrainConfig], bool]


@dataclass(frozen=True)
class Refusal:
    """Two options that cannot be used together (or one with a condition on the other).

    Attributes:
        first: the first option, as on the command line (``"--ep N>1"``).
        second: the second option.
        reason: why, and what to use instead.
        applies: whether a configuration has the pair.
    """

    first: str
    second: str
    reason: str
    applies: Applies

    def message(self) -> str:
        """The error a run with the pair gets."""
        return f"{self.first} with {self.second}: {self.reason}"


def _ulysses_heads(m: ModelConfig, p: JobDims, c: TrainConfig) -> bool:
    return p.cp > 1 and p.cp_variant == "ulysses" and (m.n_heads // p.tp) % p.cp != 0


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "--ep N>1",
        "a dense model",
        "expert parallelism shards MoE layers; give the model experts (--experts N) or use --ep 1",
        lambda m, p, c: p.ep > 1 and m.moe is None,
    ),
    Refusal(
        "--ep N>1",
        "--experts E not divisible by N",
        "each expert-parallel rank holds E / N whole experts; choose N among the divisors of E",
        lambda m, p, c: p.ep > 1 and m.moe is not None and m.moe.n_experts % p.ep != 0,
    ),
    Refusal(
        "--ep-tp",
        "--ep 1 or --tp 1",
        "expert-tensor parallelism splits each expert's hidden dim over tp inside the "
        "expert-parallel layout; give both --ep N>1 and --tp N>1, or drop --ep-tp",
        lambda m, p, c: p.ep_tp and (p.ep == 1 or p.tp == 1),
    ),
    Refusal(
        "--ep-tp",
        "--expert-ffn-dim H not divisible by --tp",
        "each tp rank holds H / tp of every expert's hidden dim; choose --tp among the divisors "
        "of H",
        lambda m, p, c: p.ep_tp and m.moe is not None and m.moe.expert_ffn_dim % p.tp != 0,
    ),
    Refusal(
        "--cp N>1",
        "--seq-len not divisible by 2N",
        "the zigzag split gives each rank two of 2N equal chunks of every sequence; choose a "
        "sequence length divisible by 2 x cp",
        lambda m, p, c: p.cp > 1 and c.seq_len % (2 * p.cp) != 0,
    ),
    Refusal(
        "--cp-variant ulysses",
        "heads per tp rank not divisible by --cp",
        "Ulysses moves whole heads between the cp ranks (n_heads / tp must divide by cp); use "
        "--cp-variant ring",
        _ulysses_heads,
    ),
    Refusal(
        "--swap",
        "--ac full",
        "full recomputation keeps only each block's input, so there is nothing to swap; use "
        "--ac selective --swap (the kept matmul outputs go to host memory) or --ac none --swap",
        lambda m, p, c: c.swap and c.ac == "full",
    ),
    Refusal(
        "--swap",
        "--ac budget:<MiB>",
        "the budget decides what stays on the device, not what goes to host memory; use --ac "
        "selective --swap",
        lambda m, p, c: c.swap and c.ac_budget_bytes is not None,
    ),
)


def check_combination(model: ModelConfig, parallel: JobDims, config: TrainConfig) -> None:
    """Raise :class:`ConfigError` with the first refused pair of the configuration."""
    for refusal in REFUSALS:
        if refusal.applies(model, parallel, config):
            raise ConfigError(refusal.message())


def combination_table() -> str:
    """The refused pairs as a Markdown table (the hp-train README holds it)."""
    rows = ["| option | with | why |", "| --- | --- | --- |"]
    rows += [f"| `{r.first}` | `{r.second}` | {r.reason} |" for r in REFUSALS]
    return "\n".join(rows)
