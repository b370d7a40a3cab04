"""The migration table in README.md is exactly ``hyper_parallel.migration_table()``, and every
row says the truth: each re-export is the hp-* object itself, each adapter's target exists,
each upstream name has a row, and upstream's ``hyper_parallel.core.*`` paths serve the root's
objects."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import hyper_parallel
from hyper_parallel.migration import resolve, rows, upstream_modules

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- migration-table:begin -->", "<!-- migration-table:end -->"
HELPERS = {"NotOfferedError", "UPSTREAM_NAMES", "__version__", "migration_table"}


def test_readme_holds_exactly_the_generated_table() -> None:
    text = README.read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1, "README.md lost its table markers"
    assert text.count(END) == 1, "README.md lost its table markers"
    between = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert between.strip("\n") + "\n" == hyper_parallel.migration_table(), (
        "README.md's migration table is stale: paste hyper_parallel.migration_table() between "
        f"{BEGIN} and {END}"
    )


def test_every_public_name_has_a_row_and_rows_are_true() -> None:
    assert set(hyper_parallel.__all__) - HELPERS == set(hyper_parallel.UPSTREAM_NAMES)
    table = rows()
    assert [r.name for r in table] == list(hyper_parallel.UPSTREAM_NAMES)
    for row in table:
        target = resolve(row.target)  # raises if the row names nothing
        obj = getattr(hyper_parallel, row.name)
        assert row.distribution == row.target.split(".")[0].replace("_", "-")
        if row.how == "same object":
            assert obj is target, row
        else:
            assert obj is not target, row  # an adapter is hyper_parallel's own
            assert getattr(obj, "__module__", "").startswith("hyper_parallel."), row


@pytest.mark.parametrize(
    "module_name",
    [
        "hyper_parallel.core.dtensor.placement_types",
        "hyper_parallel.core.shard.sharding_plan",
        "hyper_parallel.core.pipeline_parallel",
        "hyper_parallel.core.optimizer",
        "hyper_parallel.core.activation_checkpoint",
        "hyper_parallel.core.multicore",
    ],
)
def test_upstream_module_paths_serve_the_root_objects(module_name: str) -> None:
    module = importlib.import_module(module_name)
    served = upstream_modules()[module_name]
    assert served == list(module.__all__)
    for name in served:
        if hasattr(hyper_parallel, name):
            assert getattr(module, name) is getattr(hyper_parallel, name), (module_name, name)
