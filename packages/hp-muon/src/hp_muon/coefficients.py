"""Newton-Schulz coefficient schedules: one ``(a, b, c)`` per iteration.

Each iteration maps ``X -> a X + (b A + c A^2) X`` with ``A = X X^T``, an odd quintic in the
singular values of ``X``. ``torch.optim.Muon`` uses one triple for every step; later work tunes
one triple per step. A schedule here is the tuple of triples actually used, one per step:

* a single triple ``(a, b, c)`` (``torch.optim.Muon``'s form) repeats for every step;
* a sequence of triples is used in order; steps beyond its end repeat its last triple (the
  Polar Express prescription: its last polynomial is the fixed point of the iteration);
* a preset name from :data:`PRESETS`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Real
from typing import TypeAlias

__all__ = [
    "KELLER",
    "MAX_NS_STEPS",
    "PRESETS",
    "CoefficientSpec",
    "Coefficients",
    "coefficient_schedule",
]

Coefficients: TypeAlias = tuple[float, float, float]
"""One Newton-Schulz iteration's ``(a, b, c)``."""

CoefficientSpec: TypeAlias = Coefficients | Sequence[Sequence[float]] | str
"""What ``Muon(ns_coefficients=...)`` accepts: a triple, a per-step sequence, or a preset."""

MAX_NS_STEPS = 100
"""``torch.optim.Muon`` refuses this many steps or more; so do we."""

KELLER: Coefficients = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic (maximal slope at zero), ``torch.optim.Muon``'s default."""


def _polar_express() -> tuple[Coefficients, ...]:
    # Amsel, Persson, Musco, Gower, "The Polar Express" (arXiv 2505.16932), degree 5,
    # Algorithm 1: every polynomial but the last is damped by a safety factor of 1.01 for bf16.
    raw = (
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    )
    safety = 1.01
    damped = tuple((a / safety, b / safety**3, c / safety**5) for a, b, c in raw)
    return (*damped, (1.875, -1.25, 0.375))


PRESETS: Mapping[str, tuple[Coefficients, ...]] = {
    # torch.optim.Muon's constant triple.
    "keller": (KELLER,),
    # You Jiacheng's 6-step set (Feb 2025), each coefficient a multiple of 1/1024.
    "you_6step": tuple(
        (a / 1024, b / 1024, c / 1024)
        for a, b, c in (
            (3955, -8306, 5008),
            (3735, -6681, 3463),
            (3799, -6499, 3211),
            (4019, -6385, 2906),
            (2677, -3029, 1162),
            (2172, -1833, 682),
        )
    ),
    # You Jiacheng's 5-step set (Mar 2025), the default of Microsoft's Dion Muon.
    "you_5step": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    # Polar Express (degree 5, safety 1.01); run it with ns_steps=8 or more. The paper also
    # scales the input norm by 1.01; Muon normalizes by the plain Frobenius norm as torch does.
    "polar_express": _polar_express(),
}


def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _triple(value: object, where: str) -> Coefficients:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"{where} must be a sequence of 3 numbers (a, b, c), got {value!r}")
    if len(value) != 3 or not all(_is_number(v) for v in value):
        raise ValueError(f"{where} must be exactly 3 numbers (a, b, c), got {tuple(value)!r}")
    a, b, c = value
    return (float(a), float(b), float(c))


def coefficient_schedule(spec: CoefficientSpec, ns_steps: int) -> tuple[Coefficients, ...]:
    """The ``ns_steps`` triples a Newton-Schulz run uses for ``spec`` (see the module doc).

    Postconditions: the result has exactly ``ns_steps`` triples of floats; for a single triple
    every entry equals it; for a sequence ``s``, entry ``i`` is ``s[min(i, len(s) - 1)]``.

    Raises:
        ValueError: ``ns_steps`` is not an integer in ``[0, 100)``; ``spec`` is an unknown
            preset, an empty sequence, or has an entry that is not 3 numbers.
    """
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int):
        raise ValueError(f"ns_steps must be an integer, got {ns_steps!r}")
    if ns_steps >= MAX_NS_STEPS:
        raise ValueError(
            f"ns_steps={ns_steps}: Newton-Schulz needs fewer than {MAX_NS_STEPS} steps (five to "
            "ten are typical)"
        )
    if ns_steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {ns_steps}")
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(
                f"unknown Newton-Schulz coefficient preset {spec!r}; known: {sorted(PRESETS)}"
            )
        steps: tuple[Coefficients, ...] = PRESETS[spec]
    elif isinstance(spec, Sequence) and spec and not any(isinstance(v, Sequence) for v in spec):
        steps = (_triple(spec, "ns_coefficients"),)
    elif isinstance(spec, Sequence) and spec:
        steps = tuple(_triple(s, f"ns_coefficients[{i}]") for i, s in enumerate(spec))
    else:
        raise ValueError(
            "ns_coefficients must be (a, b, c), a sequence of (a, b, c) per step, or a preset "
            f"name from {sorted(PRESETS)}; got {spec!r}"
        )
    return tuple(steps[min(i, len(steps) - 1)] for i in range(ns_steps))
