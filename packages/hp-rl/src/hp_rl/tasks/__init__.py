"""Tasks with verifiable rewards: prompts, answers checked in Python, supervised warm-up text."""

from __future__ import annotations

__all__: list[str] = []
