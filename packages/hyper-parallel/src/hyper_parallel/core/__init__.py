"""Upstream HyperParallel's module paths (``hyper_parallel.core.*``), so that imports such as
``from hyper_parallel.core.pipeline_parallel import Schedule1F1B`` work unchanged. Each module
serves the same objects as the package root."""

__all__: list[str] = []
