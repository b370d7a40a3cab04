"""Integer arithmetic as a reinforcement-learning task: nothing to download, the reward computed
exactly in Python.

A problem is a prompt ``"37+45="`` and its answer ``"82"``. The supervised warm-up corpus
(:meth:`ArithmeticTask.supervised_corpus`) holds documents ``"37+45=82"``; hp-train writes the
tokenizer's end-of-sequence token after every document, so a warmed-up model answers and then
emits that token. The reward (:meth:`ArithmeticTask.reward`) therefore reads the answer up to
the end-of-sequence token's text: the same marker, in training and in the reward.

A fixed share of all problems is held out for evaluation (:meth:`ArithmeticTask.is_held_out`,
a hash of the prompt): the corpus and the training problems never contain one.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hp_train.data.tokenizer import EOS_TOKEN, MIN_VOCAB_SIZE, train_bpe

__all__ = [
    "OPERATIONS",
    "TOKENIZER_VOCAB_SIZE",
    "ArithmeticTask",
    "Problem",
    "Split",
    "train_tokenizer",
]

#: The operations a task may use: sum, difference (signed: ``"3-45="`` answers ``"-42"``) and
#: product.
OPERATIONS: tuple[str, ...] = ("+", "-", "*")

#: The vocabulary :func:`train_tokenizer` uses by default: hp-train's smallest byte-level BPE,
#: the 256 bytes and the end-of-sequence token, no merge. Every digit is then its own token,
#: so the model sees the same ten symbols in every place of every number and learns addition
#: digit by digit. hp-train's byte-level pre-tokenizer already keeps digits apart from
#: ``+ - * =`` (merges never cross them); a larger vocabulary would merge digits *within* a
#: number ("82" one token, "182" as "18" + "2"), which makes the same quantity look
#: different from problem to problem.
TOKENIZER_VOCAB_SIZE = MIN_VOCAB_SIZE

#: Which problems: ``"train"`` (never held out) or ``"eval"`` (held out).
Split = Literal["train", "eval"]

# Problems drawn per problem asked for before a split is declared (nearly) empty.
_MAX_TRIES_PER_PROBLEM = 10_000


@dataclass(frozen=True)
class Problem:
    """One question and its exact answer.

    Attributes:
        prompt: what the model is given, e.g. ``"37+45="``.
        answer: the expected completion before the end marker, e.g. ``"82"`` (no sign for
            non-negative results, ``"-"`` and no leading zero otherwise).
    """

    prompt: str
    answer: str


@dataclass(frozen=True)
class ArithmeticTask:
    """Problems ``a OP b =`` with ``a`` and ``b`` uniform on ``0..max_operand``.

    Attributes:
        max_operand: the largest operand (>= 1).
        operations: drawn uniformly per problem, from :data:`OPERATIONS`. Subtraction is
            signed (``"3-45="`` -> ``"-42"``): negative results are part of the task.
        eval_fraction: the share of all problems held out for evaluation (in ``(0, 1)``),
            chosen by a hash of the prompt (:meth:`is_held_out`), so the split is the same in
            every process and Python version and needs no list of problems.
        end_marker: the text that ends an answer: hp-train's end-of-sequence token
            (``"<|endoftext|>"``, what :func:`train_tokenizer` writes and hp-train appends to
            every corpus document). A task for hp-train's byte tokenizer uses ``"\\x00"``.
    """

    max_operand: int = 99
    operations: tuple[str, ...] = ("+",)
    eval_fraction: float = 0.1
    end_marker: str = EOS_TOKEN

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_operand, bool)
            or not isinstance(self.max_operand, int)
            or self.max_operand < 1
        ):
            raise ValueError(f"max_operand must be an integer >= 1, got {self.max_operand!r}")
        if not isinstance(self.operations, tuple) or not self.operations:
            raise ValueError(
                f"operations must be a non-empty tuple drawn from {OPERATIONS}, got "
                f"{self.operations!r}"
            )
        unknown = [op for op in self.operations if op not in OPERATIONS]
        if unknown:
            raise ValueError(f"operations {unknown} are not supported; choose from {OPERATIONS}")
        if len(set(self.operations)) != len(self.operations):
            raise ValueError(
                f"operations {self.operations} repeat one (it would be drawn more often); "
                "list each once"
            )
        if not isinstance(self.eval_fraction, float | int) or not 0 < self.eval_fraction < 1:
            raise ValueError(
                f"eval_fraction must be in (0, 1) (a share of problems held out for "
                f"evaluation), got {self.eval_fraction!r}"
            )
        if not isinstance(self.end_marker, str) or not self.end_marker:
            raise ValueError(f"end_marker must be a non-empty string, got {self.end_marker!r}")
        if any(ch.isdigit() or ch in "+-*=" for ch in self.end_marker):
            raise ValueError(
                f"end_marker {self.end_marker!r} holds a digit or an operator: an answer could "
                "not be told from its end"
            )

    def problem(self, a: int, op: str, b: int) -> Problem:
        """The problem ``a op b`` (no range check beyond the operation)."""
        if op not in OPERATIONS:
            raise ValueError(f"operation {op!r} is not supported; choose from {OPERATIONS}")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return Problem(prompt=f"{a}{op}{b}=", answer=str(value))

    def is_held_out(self, problem: Problem) -> bool:
        """Whether ``problem`` belongs to the evaluation split: the first 8 bytes of the
        SHA-256 of its prompt, as a fraction of 2**64, fall below ``eval_fraction``."""
        digest = hashlib.sha256(problem.prompt.encode("utf-8")).digest()
        return int.from_bytes(digest[:8], "big") < self.eval_fraction * 2.0**64

    def problems(self, count: int, rng: random.Random, split: Split = "train") -> list[Problem]:
        """``count`` problems of ``split`` (with replacement), drawn from ``rng``: operands
        uniform on ``0..max_operand`` and an operation uniform on ``operations``, redrawn
        while the problem is on the other side of the split.

        Raises:
            ValueError: a negative ``count``, an unknown ``split``, or a split (nearly) empty
                for these operands (too few problems to hold out ``eval_fraction``).
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        held = split == "eval"
        out: list[Problem] = []
        tries = 0
        while len(out) < count:
            tries += 1
            if tries > _MAX_TRIES_PER_PROBLEM * max(count, 1):
                raise ValueError(
                    f"found only {len(out)} of {count} {split} problems in {tries - 1} draws: "
                    f"with max_operand={self.max_operand} and eval_fraction="
                    f"{self.eval_fraction} that split is (nearly) empty; raise max_operand or "
                    "move eval_fraction away from 0 and 1"
                )
            a = rng.randint(0, self.max_operand)
            b = rng.randint(0, self.max_operand)
            problem = self.problem(a, rng.choice(self.operations), b)
            if self.is_held_out(problem) == held:
                out.append(problem)
        return out

    def answer_text(self, completion: str) -> str | None:
        """The completion's text before the first :attr:`end_marker`; None when it has none
        (the model did not stop)."""
        end = completion.find(self.end_marker)
        return None if end < 0 else completion[:end]

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 when the ``completion`` (the decoded text generated after ``problem.prompt``,
        special tokens written out) reads exactly ``problem.answer`` and then
        :attr:`end_marker`; whatever follows the marker is ignored. Else 0.0: no marker (the
        model did not stop), a wrong number, a leading zero, a plus sign, whitespace or any
        other character before the marker.

        There is no partial credit for a well-formed number: the warm-up corpus already
        teaches the format, and a format reward would pay the policy for confident wrong
        answers.
        """
        return 1.0 if self.answer_text(completion) == problem.answer else 0.0

    def supervised_corpus(self, path: Path, count: int, rng: random.Random) -> None:
        """Write ``count`` training-split problems to ``path`` as JSON Lines documents
        ``{"text": "37+45=82"}`` for a supervised warm-up with hp-train (``python -m hp_train
        --data PATH``, the default ``--text-field text``). No end marker is written: hp-train
        appends the tokenizer's end-of-sequence token after every document itself. No
        held-out problem is written."""
        problems = self.problems(count, rng, "train")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for p in problems:
                f.write(json.dumps({"text": p.prompt + p.answer}) + "\n")


def train_tokenizer(corpus: Path, out: Path, vocab_size: int = TOKENIZER_VOCAB_SIZE) -> None:
    """Train a byte-level BPE of ``vocab_size`` tokens on the JSON Lines ``corpus`` (the
    ``text`` field of every row) with hp-train's own trainer, into the folder ``out``, which
    hp-train's ``--tokenizer`` (:func:`hp_train.data.tokenizer.load_tokenizer`) loads; its
    end-of-sequence token is :data:`hp_train.data.tokenizer.EOS_TOKEN`, the task's default
    ``end_marker``. See :data:`TOKENIZER_VOCAB_SIZE` for why the default adds no merge.

    Raises:
        hp_train.config.schema.ConfigError: as ``python -m hp_train.data.tokenizer train``:
            an unreadable corpus, ``vocab_size`` below 257 or above what the corpus can merge.
    """
    # Read exactly as hp-train's tokenizer command and trainer read the corpus.
    from hp_train.data.documents import training_texts

    train_bpe(training_texts(str(corpus)), vocab_size, out)
