"""A GSM8K-format task the project generates: short multi-step word problems with small numbers.

``verl data word-problems --out DIR`` writes verl-format ``train.parquet`` / ``test.parquet`` (disjoint
questions, seeded). Each row's prompt is one user turn (chat messages, so the model's own chat template
renders it) asking for the answer as ``The answer is N.``; ``reward_model.ground_truth`` is N, and
``extra_info.answer`` is a GSM8K-style worked solution ending in ``#### N``. The scorer is
:mod:`verl.utils.reward_score.word_problems` (data source ``word_problems``).

Sized for a small pretrained chat model: SmolLM2-135M-Instruct answers ~10% of the 64 held-out problems of
seed 0 right greedily (one- and two-step problems, small operands, answers below 100; most misses answer
before working it out or stop after one step), so RL has room to improve it.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable, Sequence

from verl.utils.dataset.arithmetic import write_parquet
from verl.utils.dataset.errors import DatasetError

DATA_SOURCE = "word_problems"
INSTRUCTION = 'End with "The answer is N."'
NAMES = (("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Mia", "she"), ("Sam", "he"), ("Lily", "she"),
         ("Leo", "he"), ("Emma", "she"), ("Max", "he"), ("Zoe", "she"))
ITEMS = ("apples", "books", "pens", "cards", "balls", "cookies", "stickers", "marbles", "shells", "stamps")

# A template: (rng, name, pronoun, item) -> (question, worked solution, answer).
Template = Callable[[random.Random, str, str, str], tuple[str, str, int]]


def _buy_then_give(rng, name, he, item):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, a + b - 1)
    return (f"{name} has {a} {item}. {he.capitalize()} buys {b} more, then gives away {c}. "
            f"How many {item} does {he} have now?",
            f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}.", a + b - c)


def _gets_more(rng, name, he, item):
    a, b = rng.randint(2, 19), rng.randint(2, 9)
    return (f"{name} has {a} {item} and gets {b} more. How many {item} does {he} have now?",
            f"{a} + {b} = {a + b}.", a + b)


def _loses_some(rng, name, he, item):
    a = rng.randint(6, 19)
    b = rng.randint(2, a - 2)
    return (f"{name} has {a} {item} and loses {b} of them. How many {item} does {he} have left?",
            f"{a} - {b} = {a - b}.", a - b)


def _bags(rng, name, he, item):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {he} have?",
            f"{a} * {b} = {a * b}.", a * b)


def _has_and_packs(rng, name, he, item):
    a, b, c = rng.randint(2, 9), rng.randint(2, 5), rng.randint(2, 9)
    return (f"{name} has {a} {item} and buys {b} packs of {c} {item}. How many {item} does {he} have now?",
            f"{b} * {c} = {b * c}. {a} + {b * c} = {a + b * c}.", a + b * c)


def _share(rng, name, he, item):
    each, friends = rng.randint(2, 9), rng.randint(2, 6)
    total = each * friends
    return (f"{name} has {total} {item} and shares them equally among {friends} friends. "
            f"How many {item} does each friend get?",
            f"{total} / {friends} = {each}.", each)


def _more_than(rng, name, he, item):
    other = rng.choice([n for n, _ in NAMES if n != name])
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (f"{name} has {a} {item}. {other} has {b} more {item} than {name}. "
            f"How many {item} do they have together?",
            f"{a} + {b} = {a + b}. {a} + {a + b} = {2 * a + b}.", 2 * a + b)


def _change(rng, name, he, item):
    price, count = rng.randint(2, 9), rng.randint(2, 5)
    bill = 20 if price * count < 20 else 50
    return (f"{item.capitalize()} cost {price} dollars each. {name} buys {count} {item} and pays with a "
            f"{bill} dollar bill. How many dollars of change does {he} get?",
            f"{price} * {count} = {price * count}. {bill} - {price * count} = {bill - price * count}.",
            bill - price * count)


def _pages(rng, name, he, item):
    per_day, days, extra = rng.randint(2, 9), rng.randint(2, 5), rng.randint(2, 9)
    return (f"{name} reads {per_day} pages every day for {days} days, then {extra} more pages. "
            f"How many pages does {he} read in total?",
            f"{per_day} * {days} = {per_day * days}. {per_day * days} + {extra} = {per_day * days + extra}.",
            per_day * days + extra)


TEMPLATES: tuple[Template, ...] = (_gets_more, _loses_some, _buy_then_give, _bags, _has_and_packs, _share,
                                   _more_than, _change, _pages)


def make_problem(rng: random.Random) -> tuple[str, str, int]:
    """One (question, worked solution, answer), every choice drawn from ``rng``."""
    template = TEMPLATES[rng.randrange(len(TEMPLATES))]
    name, pronoun = NAMES[rng.randrange(len(NAMES))]
    return template(rng, name, pronoun, ITEMS[rng.randrange(len(ITEMS))])


def generate_problems(num_train: int, num_test: int, seed: int = 0
                      ) -> tuple[list[tuple[str, str, int]], list[tuple[str, str, int]]]:
    """(train, test): distinct questions, none in both splits; the test split is drawn first, so a
    larger ``num_train`` never changes the held-out set of a seed."""
    if num_train < 1 or num_test < 1:
        raise DatasetError(f"word_problems: expected num_train >= 1 and num_test >= 1, found num_train={num_train} "
                           f"num_test={num_test}")
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: list[list[tuple[str, str, int]]] = [[], []]
    # Far more distinct questions exist than any sensible request; the bound only stops a runaway loop.
    attempts, limit = 0, 50 * (num_train + num_test) + 1000
    for split, count in ((1, num_test), (0, num_train)):
        while len(splits[split]) < count:
            attempts += 1
            if attempts > limit:
                raise DatasetError(f"word_problems: could not draw {num_train + num_test} distinct questions "
                                   f"(found {len(seen)}); ask for fewer")
            problem = make_problem(rng)
            if problem[0] not in seen:
                seen.add(problem[0])
                splits[split].append(problem)
    return splits[0], splits[1]


def make_row(problem: tuple[str, str, int], split: str, index: int) -> dict:
    """One verl-format row: data_source, prompt (chat messages), ability, reward_model, extra_info."""
    question, solution, answer = problem
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "question": question,
                       "answer": f"{solution}\n#### {answer}"},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``verl data word-problems --out DIR``: the parquet splits. Returns 0."""
    parser = argparse.ArgumentParser(prog="verl data word-problems", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-test", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, test = generate_problems(args.num_train, args.num_test, args.seed)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise DatasetError(f"--out: expected a directory (new or existing), found a file at {args.out}")
    os.makedirs(args.out, exist_ok=True)
    write_parquet([make_row(p, "train", i) for i, p in enumerate(train)], os.path.join(args.out, "train.parquet"))
    write_parquet([make_row(p, "test", i) for i, p in enumerate(test)], os.path.join(args.out, "test.parquet"))
    print(f"word_problems: {len(train)} train / {len(test)} test problems -> {args.out}")
    return 0
