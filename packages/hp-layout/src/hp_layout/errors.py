"""Exceptions raised by hp_layout.

Every error is a ``ValueError`` subclass, so callers that validate user input can catch one
type, while tests and tools can tell the failing concept apart.
"""

from __future__ import annotations

__all__ = [
    "LayoutError",
    "MeshError",
    "PlacementError",
    "RedistributionError",
    "TopologyError",
]


class LayoutError(ValueError):
    """Base class of every error raised by hp_layout."""


class MeshError(LayoutError):
    """A mesh was built from an inconsistent rank grid, or asked for an unknown axis or rank."""


class TopologyError(LayoutError):
    """A topology's tiers are inconsistent, or a group lies outside the topology."""


class PlacementError(LayoutError):
    """A placement does not fit the tensor shape or the mesh it is applied to."""


class RedistributionError(LayoutError):
    """A redistribution between two layouts is impossible or was asked for incorrectly."""
