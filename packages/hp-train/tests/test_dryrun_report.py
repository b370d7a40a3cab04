"""The dry run's report (issue 45, 6): units that scale, a "does not fit" line, ``--grad-accum``
as the trainer spells it, and lines no wider than 100 columns."""

from __future__ import annotations

import re

import pytest

from hp_planner.price import StepShape, dry_run, topology_preset
from hp_train.config.presets import model_preset
from hp_train.config.schema import ParallelConfig
from hp_train.dryrun import TrainerModel
from hp_train.dryrun.cli import main
from hp_train.dryrun.report import human_bytes, human_seconds, wrap_lines

#: The README's first command, and the same without checkpointing (which does not fit).
FIRST = ["--model", "moe_505b", "--topology", "ascend_supernode", "--dp-shard", "768", "--ep"]
GIB = 2**30


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (40 * 1024 + 512, "40.50 KiB"),
        (3 * 2**20, "3.00 MiB"),
        (1.5 * GIB, "1.50 GiB"),
        (326 * GIB, "326.00 GiB"),
        (2.5 * 2**40, "2.50 TiB"),
    ],
)
def test_human_bytes(n: float, text: str) -> None:
    assert human_bytes(n) == text


@pytest.mark.parametrize(
    ("t", "text"), [(14.5171, "14.517s"), (0.0123, "12.300ms"), (2.7e-5, "27.000us")]
)
def test_human_seconds(t: float, text: str) -> None:
    assert human_seconds(t) == text


def test_wrapping_keeps_every_word_and_indents_the_rest() -> None:
    words = [f"w{i}" for i in range(200)]
    line = "note: " + " ".join(words)
    wrapped = wrap_lines(["short", line], 40)
    assert wrapped[0] == "short"
    assert all(len(w) <= 40 for w in wrapped)
    assert all(w.startswith("    ") for w in wrapped[2:])
    assert " ".join(" ".join(wrapped[1:]).split()) == line


def test_a_tiny_model_reads_in_kib_not_zero_gib(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, ["--model", "tiny", "--dp-shard", "2"])
    assert code == 0
    assert re.search(r"(?<![\d.])0\.00 GiB", out) is None
    assert re.search(r"(?<![\d.])0\.000s", out) is None
    run = dry_run(
        TrainerModel(model_preset("tiny").model),
        ParallelConfig(1, 2, 1, 1),
        topology_preset("single_host:2"),
        StepShape(model_preset("tiny").global_batch, model_preset("tiny").seq_len),
    )
    # The parameters' line in KiB, computed here from the prediction's bytes.
    kib = run.memory.parameters / 1024
    assert 1 <= kib < 1024
    assert f"parameters {kib:.2f} KiB" in " ".join(out.split())
    assert "fits: predicted peak" in out
    assert "does not fit" not in out


def test_a_prediction_over_the_device_memory_says_it_does_not_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _run(capsys, [*FIRST, "16", "--ac", "none"])
    assert code == 0
    text = " ".join(out.split())
    total = float(text.split("total (peak) ")[1].split(" GiB")[0])
    assert total > 64  # the Ascend die's 64 GiB
    assert (
        f"does not fit: predicted peak {total:.2f} GiB per rank vs 64.00 GiB of ascend_910c_die "
        f"({total / 64:.1f}x; {total - 64:.2f} GiB over)"
    ) in text
    assert "--ac full" in text  # activations are most of it: what to change
    assert "--search finds the fastest layout that fits" in text
    code, out, _ = _run(capsys, [*FIRST, "16", "--ac", "full"])
    assert "does not fit" not in out
    assert "fits: predicted peak" in out


def test_every_line_fits_100_columns(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        [*FIRST, "16", "--ac", "full"],
        ["--model", "tiny-moe", "--dp-shard", "1", "--cp", "2", "--cp-variant", "ulysses"],
        ["--model", "tiny", "--topology", "single_host:4", "--search", "--top", "2"],
    ):
        code, out, _ = _run(capsys, argv)
        assert code == 0
        assert max(len(line) for line in out.splitlines()) <= 100, argv
        assert "note:" in out or "#1" in out


def test_grad_accum_is_the_trainers_name(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--model", "tiny", "--dp-shard", "2"]
    code, new, err = _run(capsys, [*tiny, "--grad-accum", "2"])
    assert code == 0
    assert err == ""
    assert "grad_accum=2" in new
    one = _run(capsys, tiny)[1]
    assert "grad_accum=1" in one
    assert one != new  # half the sequences per microbatch
    # The old spelling: the same prediction, and a note naming the new one.
    code, old, err = _run(capsys, [*tiny, "--microbatches", "2"])
    assert (code, old) == (0, new)
    assert "--microbatches 2 without --pp is deprecated" in err
    assert "use --grad-accum 2" in err
    code, _, err = _run(capsys, [*tiny, "--microbatches", "2", "--grad-accum", "4"])
    assert code == 2
    assert "give --grad-accum alone" in err
    # With --pp, accumulation runs --grad-accum pipeline steps of --microbatches each.
    piped = ["--model", "tiny", "--dp-shard", "1", "--pp", "2", "--microbatches", "2"]
    code, accumulated, err = _run(capsys, [*piped, "--grad-accum", "2"])
    assert (code, err) == (0, "")
    assert "microbatches=2 grad_accum=2" in accumulated
    assert "grad_accum" not in _run(capsys, piped)[1]
