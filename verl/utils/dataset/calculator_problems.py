"""Word problems whose numbers are too large to do in the head: the agentic (calculator tool) RL task.

``verl data calculator-problems --out DIR`` writes, with disjoint questions (seeded):

* ``train.parquet`` / ``test.parquet``: verl-format RL rows for ``tool_agent`` (``agent_name``). The prompt is a
  system turn describing the ``calculator`` tool and its hermes call format, then the question, which asks for
  ``The answer is N.``; ``reward_model.ground_truth`` is N (scored by
  :mod:`verl.utils.reward_score.word_problems`, data source ``calculator_word_problems``).
* ``sft_train.parquet`` / ``sft_test.parquet``: tool-use demonstrations on *other* questions, for a short SFT
  warm-up (``verl sft``): one row per assistant turn, ``prompt`` the conversation so far (chat messages: the
  model's own template renders them as the agent loop does), ``response`` what the assistant says next -- first
  a hermes call ``<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>``, then,
  after the tool's answer, ``The answer is N.``

The problems are the GSM8K-style templates of :mod:`verl.utils.dataset.word_problems` with operands in the
hundreds and thousands (products of two- and three-digit numbers, sums of four-digit ones), one or two
operations each; a single calculator expression computes every answer. SmolLM2-135M-Instruct gets almost none
of them right without the tool, and never calls a tool from the system prompt alone (it answers in prose),
which is why the warm-up exists. The demonstrations cover every template by default (``--sft-templates`` picks
some): a 2-step warm-up on them teaches the call format but not yet each template's expression (held-out greedy
accuracy with the tool 0.39), which GRPO then raises (0.52 after 10 steps). Demonstrated on the one-operation
templates only, the warm-up answers exactly those and never composes ``a * b + c`` even at temperature 1: every
group is all right or all wrong, GRPO's advantages are all zero and nothing is learned.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Sequence

from verl.utils.dataset import word_problems
from verl.utils.dataset.arithmetic import check_out_dir, rl_row, write_parquet, write_rl_splits
from verl.utils.dataset.errors import DatasetError
from verl.utils.dataset.word_problems import INSTRUCTION, ITEMS, NAMES, Template

DATA_SOURCE = "calculator_word_problems"
AGENT_NAME = "tool_agent"
SYSTEM_PROMPT = ('Use the calculator for the arithmetic: <tool_call>{"name": "calculator", "arguments": '
                 '{"expression": "123 * 45 + 678"}}</tool_call>')

# The word-problem templates' questions with operands in the hundreds and thousands; ``steps`` is the one
# calculator expression that computes the answer.
_ASKED = {t.kind: t.question for t in word_problems.TEMPLATES}
TEMPLATES: tuple[Template, ...] = (
    Template("gets_more", (("a", 1000, 9999), ("b", 1000, 9999)), _ASKED["gets_more"], "{a} + {b}", "n",
             lambda v: {"n": v["a"] + v["b"]}),
    Template("loses_some", (("a", 3000, 9999), ("b", 1000, lambda v: v["a"] - 1000)), _ASKED["loses_some"],
             "{a} - {b}", "n", lambda v: {"n": v["a"] - v["b"]}),
    Template("bags", (("a", 12, 99), ("b", 102, 999)), _ASKED["bags"], "{a} * {b}", "n",
             lambda v: {"n": v["a"] * v["b"]}),
    Template("buy_then_give", (("a", 1000, 9999), ("b", 1000, 9999), ("c", 1000, lambda v: v["a"] + v["b"] - 1000)),
             _ASKED["buy_then_give"], "{a} + {b} - {c}", "n", lambda v: {"n": v["a"] + v["b"] - v["c"]}),
    Template("has_and_packs", (("a", 100, 999), ("b", 12, 99), ("c", 12, 99)), _ASKED["has_and_packs"],
             "{a} + {b} * {c}", "n", lambda v: {"n": v["a"] + v["b"] * v["c"]}),
    Template("share", (("each", 102, 999), ("friends", 12, 49)), _ASKED["share"], "{total} / {friends}", "each",
             lambda v: {"total": v["each"] * v["friends"]}),
    Template("pages", (("per_day", 12, 99), ("days", 12, 99), ("extra", 100, 999)), _ASKED["pages"],
             "{per_day} * {days} + {extra}", "n", lambda v: {"n": v["per_day"] * v["days"] + v["extra"]}),
    Template("change", (("price", 12, 99), ("count", 12, 99)),
             "{Item} cost {price} dollars each. {name} buys {count} {item} and pays with {bill} dollars. How many "
             "dollars of change does {he} get?", "{bill} - {price} * {count}", "n",
             lambda v: {"bill": 10000, "n": 10000 - v["price"] * v["count"]}),
)
# The demonstrations' default: the one-operation templates ("a + b", "a - b", "a * b", "a / b"). The two-operation
# ones ("a + b - c", "a + b * c", "a * b + c", "10000 - a * b": half of the RL problems) are left for RL.
ONE_OPERATION_TEMPLATES = (0, 1, 2, 5)


def make_problem(rng: random.Random, templates: Sequence[int] | None = None) -> tuple[str, str, int]:
    """One (question, expression, answer), every choice drawn from ``rng``, from ``templates`` (indices into
    TEMPLATES; all when None)."""
    pool = list(range(len(TEMPLATES))) if templates is None else list(templates)
    template = TEMPLATES[pool[rng.randrange(len(pool))]]
    name, pronoun = NAMES[rng.randrange(len(NAMES))]
    return template(rng, name, pronoun, ITEMS[rng.randrange(len(ITEMS))])


def tool_call_text(expression: str) -> str:
    """The hermes call the system prompt shows: ``<tool_call>{json}</tool_call>``."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def answer_text(answer: int) -> str:
    return f"The answer is {answer}."


def prompt_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"{question} {INSTRUCTION}"}]


def make_row(problem: tuple[str, str, int], split: str, index: int) -> dict:
    """One verl-format RL row for ``tool_agent``."""
    question, expression, answer = problem
    return {"agent_name": AGENT_NAME, **rl_row(DATA_SOURCE, prompt_messages(question), answer, split, index,
                                                question=question, expression=expression,
                                                answer=f"{expression} = {answer}\n#### {answer}")}


def demonstration_rows(problem: tuple[str, str, int], split: str, index: int) -> list[dict]:
    """The two SFT rows of one solved problem: (question -> call), (question, call, result -> answer)."""
    question, expression, answer = problem
    call = tool_call_text(expression)
    first = prompt_messages(question)
    second = first + [{"role": "assistant", "content": call}, {"role": "tool", "content": str(answer)}]
    info = {"split": split, "index": index}
    return [{"prompt": first, "response": call, "extra_info": {**info, "turn": 1}},
            {"prompt": second, "response": answer_text(answer), "extra_info": {**info, "turn": 2}}]


def generate_problems(counts: Sequence[int], seed: int = 0, templates: Sequence[Sequence[int] | None] | None = None,
                      held_out: Sequence[bool] | None = None) -> list[list[tuple[str, str, int]]]:
    """Distinct questions, ``counts[k]`` for split k (drawn in order: later splits never change earlier ones for
    a seed), no question in two splits; ``templates[k]`` restricts split k's templates. ``held_out[k]``: split k is
    held out, and held out by computation: no problem of a split that is not (training data) has the expression of
    one that is (the same operations on the same numbers, whatever the name and item), either way round."""
    if any(c < 0 for c in counts) or not any(counts):
        raise DatasetError(f"calculator_problems: expected non-negative counts, at least one positive, found "
                           f"{list(counts)}")
    templates = list(templates) if templates is not None else [None] * len(counts)
    held_out = list(held_out) if held_out is not None else [False] * len(counts)
    rng = random.Random(seed)
    seen: set[str] = set()
    computed: dict[bool, set[str]] = {True: set(), False: set()}  # expressions of the held-out / training splits
    splits: list[list[tuple[str, str, int]]] = [[] for _ in counts]
    attempts, limit = 0, 50 * sum(counts) + 1000
    for k, count in enumerate(counts):
        while len(splits[k]) < count:
            attempts += 1
            if attempts > limit:
                raise DatasetError(f"calculator_problems: could not draw {sum(counts)} distinct questions "
                                   f"(found {len(seen)}); ask for fewer")
            problem = make_problem(rng, templates[k])
            if problem[0] not in seen and problem[1] not in computed[not held_out[k]]:
                seen.add(problem[0])
                computed[held_out[k]].add(problem[1])
                splits[k].append(problem)
    return splits


def _template_list(text: str) -> list[int]:
    try:
        picked = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        picked = []
    if not picked or any(not 0 <= i < len(TEMPLATES) for i in picked):
        raise DatasetError(f"--sft-templates: expected comma-separated template indices in 0..{len(TEMPLATES) - 1}, "
                           f"found {text!r}")
    return picked


def main(argv: Sequence[str] | None = None) -> int:
    """``verl data calculator-problems --out DIR``: the RL splits and the SFT demonstrations. Returns 0."""
    parser = argparse.ArgumentParser(prog="verl data calculator-problems", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num-train", type=int, default=2000, help="RL training problems")
    parser.add_argument("--num-test", type=int, default=64, help="held-out RL problems")
    parser.add_argument("--num-sft", type=int, default=256, help="demonstrated problems (2 SFT rows each)")
    parser.add_argument("--num-sft-test", type=int, default=16, help="held-out demonstrated problems")
    parser.add_argument("--sft-templates", default="all",
                        help=f"demonstrate only these templates (indices 0..{len(TEMPLATES) - 1}, comma-separated, "
                             "e.g. the one-operation ones " + ",".join(map(str, ONE_OPERATION_TEMPLATES)) +
                             "; default all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.num_train < 1 or args.num_test < 1 or args.num_sft < 1 or args.num_sft_test < 1:
        raise DatasetError(f"calculator_problems: expected every count >= 1, found num_train={args.num_train} "
                           f"num_test={args.num_test} num_sft={args.num_sft} num_sft_test={args.num_sft_test}")
    sft_templates = None if args.sft_templates == "all" else _template_list(args.sft_templates)
    check_out_dir(args.out)
    test, train, sft_test, sft = generate_problems(
        [args.num_test, args.num_train, args.num_sft_test, args.num_sft], args.seed,
        [None, None, sft_templates, sft_templates], held_out=[True, False, True, False])
    write_rl_splits(args.out, make_row, train, test)
    for name, problems in (("sft_train", sft), ("sft_test", sft_test)):
        rows = [row for i, p in enumerate(problems) for row in demonstration_rows(p, name, i)]
        write_parquet(rows, os.path.join(args.out, f"{name}.parquet"))
    print(f"calculator_problems: {len(train)} train / {len(test)} test problems, {len(sft)} + {len(sft_test)} "
          f"demonstrated ({2 * len(sft)} + {2 * len(sft_test)} SFT rows) -> {args.out}")
    return 0
