"""The arithmetic task: problems, reward, held-out split, corpus, tokenizer and hp-train."""

from __future__ import annotations

import json
import operator
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hp_rl.tasks.arithmetic import ArithmeticTask, Problem, train_tokenizer
from hp_testing import run_on_ranks
from hp_train.data.tokenizer import EOS_TOKEN, load_tokenizer

EOS = "<|endoftext|>"
OPS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
PROMPT = re.compile(r"^(\d+)([-+*])(\d+)=$")


def _all_problems(task: ArithmeticTask) -> list[Problem]:
    return [
        task.problem(a, op, b)
        for a in range(task.max_operand + 1)
        for b in range(task.max_operand + 1)
        for op in task.operations
    ]


# --- reward -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("82" + EOS, 1.0),
        ("82" + EOS + "garbage 17" + EOS, 1.0),  # after the end marker: ignored
        ("82" + EOS + EOS, 1.0),
        ("81" + EOS, 0.0),
        ("082" + EOS, 0.0),  # leading zero
        ("+82" + EOS, 0.0),
        (" 82" + EOS, 0.0),
        ("82 " + EOS, 0.0),
        ("82\n" + EOS, 0.0),
        ("8 2" + EOS, 0.0),
        ("82", 0.0),  # never stopped
        ("82\n", 0.0),  # a newline is not the end marker
        ("828" + EOS, 0.0),
        ("", 0.0),
        (EOS, 0.0),
        ("<|endoftext|82" + EOS, 0.0),
        ("82.0" + EOS, 0.0),
    ],
)
def test_reward_hand_cases(completion: str, reward: float) -> None:
    task = ArithmeticTask()
    assert task.reward(Problem("37+45=", "82"), completion) == reward


def test_reward_of_negative_answers_and_another_marker() -> None:
    """Signed subtraction; a task for the byte tokenizer ends answers with NUL."""
    task = ArithmeticTask(operations=("-",), end_marker="\x00")
    problem = task.problem(3, "-", 45)
    assert problem == Problem("3-45=", "-42")
    assert task.reward(problem, "-42\x00xx") == 1.0
    assert task.reward(problem, "42\x00") == 0.0
    assert task.reward(problem, "-42" + EOS) == 0.0
    assert task.reward(problem, "- 42\x00") == 0.0


def test_the_default_marker_is_hp_trains_end_of_sequence() -> None:
    assert ArithmeticTask().end_marker == EOS_TOKEN == EOS


# --- problems and the split -------------------------------------------------------------------


def test_problems_are_correct_uniform_and_seeded() -> None:
    task = ArithmeticTask(max_operand=12, operations=("+", "-", "*"))
    problems = task.problems(3000, random.Random(7))
    assert problems == task.problems(3000, random.Random(7))
    assert problems != task.problems(3000, random.Random(8))
    operands: set[int] = set()
    seen_ops: dict[str, int] = dict.fromkeys(OPS, 0)
    for p in problems:
        m = PROMPT.match(p.prompt)
        assert m is not None, p
        a, op, b = int(m[1]), m[2], int(m[3])
        assert p.answer == str(OPS[op](a, b))
        operands |= {a, b}
        seen_ops[op] += 1
    assert operands == set(range(13))
    assert min(seen_ops.values()) > 800  # each operation about a third of 3000
    assert any(p.answer.startswith("-") for p in problems)


def test_held_out_problems_never_reach_training() -> None:
    """The evaluation split is about eval_fraction of all problems, training draws never hold
    one, evaluation draws hold nothing else, and the corpus holds none."""
    task = ArithmeticTask(max_operand=40, operations=("+", "-"), eval_fraction=0.2)
    every = _all_problems(task)
    held = {p.prompt for p in every if task.is_held_out(p)}
    assert 0.17 < len(held) / len(every) < 0.23
    train = task.problems(4000, random.Random(1))
    evaluation = task.problems(500, random.Random(1), split="eval")
    assert not held & {p.prompt for p in train}
    assert {p.prompt for p in evaluation} <= held
    assert len({p.prompt for p in evaluation}) > 200


def test_the_split_is_the_same_in_another_process() -> None:
    """No per-process hash salt: a fresh interpreter with another PYTHONHASHSEED holds out the
    same problems."""
    task = ArithmeticTask(max_operand=15)
    here = sorted(p.prompt for p in _all_problems(task) if task.is_held_out(p))
    code = (
        "from hp_rl.tasks.arithmetic import ArithmeticTask as T\n"
        "t = T(max_operand=15)\n"
        "print(sorted(t.problem(a, '+', b).prompt for a in range(16) for b in range(16) "
        "if t.is_held_out(t.problem(a, '+', b))))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(here)


def test_task_and_draws_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="not supported"):
        ArithmeticTask(operations=("/",))
    with pytest.raises(ValueError, match="non-empty tuple"):
        ArithmeticTask(operations=())
    with pytest.raises(ValueError, match="repeat"):
        ArithmeticTask(operations=("+", "+"))
    with pytest.raises(ValueError, match="max_operand"):
        ArithmeticTask(max_operand=0)
    with pytest.raises(ValueError, match="eval_fraction"):
        ArithmeticTask(eval_fraction=1.0)
    with pytest.raises(ValueError, match="end_marker"):
        ArithmeticTask(end_marker="=")
    task = ArithmeticTask(max_operand=1, eval_fraction=0.001)
    with pytest.raises(ValueError, match="that split is"):
        task.problems(1, random.Random(0), split="eval")
    with pytest.raises(ValueError, match="count"):
        task.problems(-1, random.Random(0))
    with pytest.raises(ValueError, match="split"):
        task.problems(1, random.Random(0), split="test")  # type: ignore[arg-type]


# --- corpus, tokenizer, hp-train --------------------------------------------------------------


def test_supervised_corpus_is_json_lines_of_solved_training_problems(tmp_path: Path) -> None:
    task = ArithmeticTask(max_operand=30, operations=("+", "-", "*"))
    path = tmp_path / "sub" / "corpus.jsonl"
    task.supervised_corpus(path, 500, random.Random(3))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 500
    held = {p.prompt for p in _all_problems(task) if task.is_held_out(p)}
    for row in rows:
        assert set(row) == {"text"}
        prompt, answer = row["text"].split("=")
        m = PROMPT.match(prompt + "=")
        assert m is not None, row
        assert answer == str(OPS[m[2]](int(m[1]), int(m[3])))
        assert prompt + "=" not in held
        assert EOS not in row["text"]


def test_tokenizer_round_trips_every_problem_and_keeps_digits_apart(tmp_path: Path) -> None:
    """hp-train's load_tokenizer loads it; every problem of the task, with its end marker,
    encodes and decodes back; each digit is one token; the answer's tokens follow the
    prompt's without a merge across '='."""
    task = ArithmeticTask(max_operand=25, operations=("+", "-", "*"))
    corpus = tmp_path / "corpus.jsonl"
    task.supervised_corpus(corpus, 800, random.Random(0))
    train_tokenizer(corpus, tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.eos_token == EOS
    assert tok.vocab_size == 257
    digit_ids = [tok.encode(str(d)) for d in range(10)]
    assert all(len(ids) == 1 for ids in digit_ids)
    for p in _all_problems(task):
        text = p.prompt + p.answer
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode([*ids, tok.eos_id]) == text + EOS
        assert ids == tok.encode(p.prompt) + tok.encode(p.answer)
        assert len(ids) == len(text)  # one token per character: digits never merged
        assert task.reward(p, tok.decode([*tok.encode(p.answer), tok.eos_id])) == 1.0


def test_a_larger_vocabulary_still_never_merges_across_the_answer_boundary(
    tmp_path: Path,
) -> None:
    task = ArithmeticTask(max_operand=99)
    corpus = tmp_path / "corpus.jsonl"
    task.supervised_corpus(corpus, 2000, random.Random(0))
    train_tokenizer(corpus, tmp_path / "tok", vocab_size=300)
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.vocab_size == 300
    for p in task.problems(500, random.Random(1)) + task.problems(100, random.Random(1), "eval"):
        ids = tok.encode(p.prompt + p.answer)
        assert ids == tok.encode(p.prompt) + tok.encode(p.answer)
        assert tok.decode(ids) == p.prompt + p.answer


def _train_on_pool_rank(argv: list[str]) -> int:
    """One rank of ``hp_train *argv`` (the command line's parse, then its trainer)."""
    from hp_train.config.cli import parse
    from hp_train.runtime import init_runtime
    from hp_train.trainer import Trainer

    runtime = init_runtime("cpu", threads=1)
    model, parallel, config, options, _ = parse(argv, runtime.world_size)
    Trainer(model, parallel, config, options, runtime).run()
    return 0


def test_hp_train_trains_on_the_corpus_with_the_tokenizer(tmp_path: Path) -> None:
    """Two steps of hp-train's command line on two ranks: the corpus is read as JSON Lines
    documents, each followed by the end-of-sequence token (tokens = bytes + 1 per document),
    and the loss is finite."""
    task = ArithmeticTask(max_operand=99, operations=("+", "-"))
    corpus = tmp_path / "corpus.jsonl"
    task.supervised_corpus(corpus, 600, random.Random(5))
    train_tokenizer(corpus, tmp_path / "tok")
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    # Each document is the problem and its answer alone: the end of sequence comes from hp-train.
    assert all(re.fullmatch(r"\d+[-+]\d+=-?\d+", t) for t in texts)
    want_tokens = sum(len(t) + 1 for t in texts)
    argv = [
        "--model", "tiny", "--steps", "2", "--seq-len", "32", "--global-batch", "4", "--quiet",
        "--data", str(corpus), "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "run"),
    ]  # fmt: skip
    assert run_on_ranks(2, _train_on_pool_rank, argv, timeout=300) == [0, 0]
    log = (tmp_path / "run" / "logs" / "rank_0.log").read_text()
    assert f"600 training documents, {want_tokens:,} tokens" in log, log[-3000:]
    assert "(vocab 257, eos id 0)" in log
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records if "loss" in r and "step" in r]
    assert len(losses) == 2
    assert all(0 < loss < 20 for loss in losses)
