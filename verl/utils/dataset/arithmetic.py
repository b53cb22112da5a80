"""The quickstart task: two-digit arithmetic prompts (``37+48=``) with exact-match answers.

``verl data arithmetic --out DIR`` writes verl-format ``train.parquet``/``test.parquet`` (seeded, disjoint by
computation: ``a+b`` and ``b+a`` count as one), ``test_ood.parquet`` (out-of-form held-out problems: one operand
with a digit fewer or more than training ever shows, rows marked ``extra_info.out_of_form``) and a
character-level tokenizer in HF format under ``DIR/tokenizer``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from verl.utils.dataset.errors import DatasetError

DATA_SOURCE = "arithmetic"
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
# Ids 0-3 are the specials (pad first, so a zero-initialised buffer is padding), then the characters.
CHARACTERS = list("0123456789+-=*/() \n")


def computation_key(problem: tuple[int, str, int]) -> tuple:
    """What a problem computes: ``a+b`` and ``b+a`` are one computation (addition commutes), ``a-b`` and
    ``b-a`` two. Held-out splits are disjoint in this key, not only in the prompt's text."""
    a, op, b = problem
    return (op, min(a, b), max(a, b)) if op == "+" else (op, a, b)


def generate_problems(
    num_train: int, num_test: int, seed: int = 0, ops: str = "+", low: int = 10, high: int = 99
) -> tuple[list[tuple[int, str, int]], list[tuple[int, str, int]]]:
    """(train, test) (a, op, b) problems with a, b in [low, high], shuffled with ``seed``: the test split's
    problems are distinct computations (:func:`computation_key`) and no training problem computes one of them
    (``37+48=`` held out keeps ``48+37=`` out of train)."""
    unknown = sorted(set(ops) - {"+", "-"})
    if not ops or unknown:
        raise DatasetError(f"arithmetic: expected ops made of '+' and '-', found {ops!r}")
    if low > high:
        raise DatasetError(f"arithmetic: expected low <= high, found low={low} high={high}")
    problems = [(a, op, b) for op in dict.fromkeys(ops) for a in range(low, high + 1) for b in range(low, high + 1)]
    if num_train < 1 or num_test < 1 or num_train + num_test > len(problems):
        raise DatasetError(
            f"arithmetic: expected 1 <= num_train, 1 <= num_test and num_train + num_test <= {len(problems)} "
            f"distinct problems, found num_train={num_train} num_test={num_test}"
        )
    random.Random(seed).shuffle(problems)
    test: list[tuple[int, str, int]] = []
    held_out: set[tuple] = set()
    for problem in problems:
        if len(test) == num_test:
            break
        if computation_key(problem) not in held_out:
            held_out.add(computation_key(problem))
            test.append(problem)
    train = [p for p in problems if computation_key(p) not in held_out][:num_train]
    if len(test) < num_test or len(train) < num_train:
        raise DatasetError(
            f"arithmetic: {num_test} held-out computations leave {len(train)} training problems that compute none "
            f"of them, found num_train={num_train}; ask for fewer"
        )
    return train, test


def generate_out_of_form(num: int, seed: int = 0, ops: str = "+", low: int = 10, high: int = 99
                         ) -> list[tuple[int, str, int]]:
    """``num`` distinct problems in a form :func:`generate_problems` never draws: one operand in [low, high], the
    other with one digit fewer (half of them, when such operands exist) or one more (``7+48=``, ``48+137=``;
    either order). No training problem computes one of them; with the default range the char tokenizer writes
    every prompt in at most 7 tokens and every answer in at most 4."""
    if num < 1:
        raise DatasetError(f"arithmetic: expected num >= 1 out-of-form problems, found {num}")
    digits = len(str(low))
    if low < 1 or len(str(high)) != digits or low > high:
        raise DatasetError(f"arithmetic: out-of-form problems need 1 <= low <= high of one digit count, found "
                           f"low={low} high={high}")

    def pairs(width: int) -> list[tuple[int, str, int]]:
        others = range(10 ** (width - 1), 10 ** width) if width > 0 else range(0)
        return sorted({(x, op, y) for op in dict.fromkeys(ops) for n in range(low, high + 1) for m in others
                       for x, y in ((n, m), (m, n))})

    shorter, longer = pairs(digits - 1), pairs(digits + 1)
    want_short = min(num // 2, len(shorter))
    if num - want_short > len(longer):
        raise DatasetError(f"arithmetic: expected at most {len(shorter) + len(longer)} out-of-form problems, "
                           f"found num={num}")
    rng = random.Random(seed)
    chosen = rng.sample(shorter, want_short) + rng.sample(longer, num - want_short)
    rng.shuffle(chosen)
    return chosen


def answer_of(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def make_row(problem: tuple[int, str, int], split: str, index: int, out_of_form: bool = False) -> dict:
    """One verl-format row: data_source, prompt (chat messages), ability, reward_model, extra_info.
    ``out_of_form``: ``extra_info.out_of_form`` is set, and validation reports the row apart
    (``val/accuracy_out_of_form``)."""
    a, op, b = problem
    return rl_row(DATA_SOURCE, [{"role": "user", "content": f"{a}{op}{b}="}], answer_of(a, op, b), split, index,
                  out_of_form)


def rl_row(data_source: str, prompt: list[dict], ground_truth: int, split: str, index: int, out_of_form: bool = False,
           **extra_info) -> dict:
    """A verl-format row of a generated math task scored by its ground-truth answer: data_source, prompt (chat
    messages), ability, reward_model, extra_info (split, index, ``out_of_form`` where set, and ``extra_info``)."""
    return {
        "data_source": data_source,
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(ground_truth)},
        "extra_info": {"split": split, "index": index, **extra_info, **({"out_of_form": True} if out_of_form else {})},
    }


def write_parquet(rows: list[dict], path: str) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path)


def check_out_dir(out: str) -> None:
    """``--out`` of a data command: a directory, new or existing."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise DatasetError(f"--out: expected a directory (new or existing), found a file at {out}")


def write_rl_splits(out: str, make_row, train: list, test: list, ood: list = ()) -> None:
    """``out``/train.parquet, test.parquet and (when ``ood``) test_ood.parquet, each problem as ``make_row(problem,
    split, index[, out_of_form=True])``; a test_ood.parquet an earlier call left is removed when there is no set."""
    os.makedirs(out, exist_ok=True)
    write_parquet([make_row(p, "train", i) for i, p in enumerate(train)], os.path.join(out, "train.parquet"))
    write_parquet([make_row(p, "test", i) for i, p in enumerate(test)], os.path.join(out, "test.parquet"))
    ood_path = os.path.join(out, "test_ood.parquet")
    if ood:
        write_parquet([make_row(p, "test_ood", i, out_of_form=True) for i, p in enumerate(ood)], ood_path)
    elif os.path.exists(ood_path):
        os.remove(ood_path)  # a stale set from an earlier call is not this call's


def build_char_tokenizer(out_dir: str) -> str:
    """Save a character-level tokenizer (one token per character of CHARACTERS) in HF format.

    Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json so that
    ``AutoTokenizer.from_pretrained(out_dir)`` loads it with pad/bos/eos set. Returns out_dir.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every char is a token
    tokenizer.decoder = decoders.Fuse()  # join characters back without spaces
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS.values()))

    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **SPECIAL_TOKENS,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(SPECIAL_TOKENS, f, indent=2)
    return out_dir


# ----------------------------------------------------------------------------- SFT label noise
# ``data.label_noise`` makes the SFT warm start deliberately imperfect so that RL has room to improve it:
# ``random`` gives that fraction of the targets another example's answer; ``drop_carry`` gives that
# fraction of the problems with a carry (or borrow) the answer computed without it -- a systematic,
# human-like error learnt next to the right skill, so sampling still finds the right answer and RL's
# exact-match reward can flip the greedy choice.
def add_label_noise(pairs: list[tuple], fraction: float, seed: int) -> tuple:
    """(pairs, count): ``round(fraction * N)`` seeded rows get another row's different response."""
    rng = random.Random(seed)
    responses = [r for _, r in pairs]
    if len(set(responses)) < 2:
        return pairs, 0
    noisy = list(pairs)
    chosen = rng.sample(range(len(pairs)), round(fraction * len(pairs)))
    for i in chosen:
        wrong = responses[i]
        while wrong == responses[i]:
            wrong = responses[rng.randrange(len(responses))]
        noisy[i] = (pairs[i][0], wrong)
    return noisy, len(chosen)


_PROBLEM = re.compile(r"^\s*(\d+)\s*([+-])\s*(\d+)\s*=\s*$")


def drop_carry_answer(prompt: str) -> str | None:
    """The answer to ``a+b=`` / ``a-b=`` computed by forgetting the carry out of (or the borrow into)
    the ones digit, or None when the problem has none (or is not such a prompt).

    ``37+48=`` -> ``75`` (7+8=15: write 5, forget the 1); ``12+13=`` -> None; ``52-37=`` -> ``25``
    (2-7: borrow to get 5, forget to take it from the tens); ``37-52=`` -> ``-25`` (the same slip on
    52-37, sign kept).
    """
    match = _PROBLEM.match(prompt)
    if match is None:
        return None
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    if op == "+":
        return str(a + b - 10) if a % 10 + b % 10 >= 10 else None
    big, small, sign = (a, b, "") if a >= b else (b, a, "-")
    if big % 10 >= small % 10:
        return None
    return sign + str(big - small + 10)


def add_drop_carry_noise(pairs: list[tuple], fraction: float, seed: int) -> tuple:
    """(pairs, count): ``round(fraction * M)`` seeded rows of the M that involve a carry (or borrow)
    get the carry-dropped answer (:func:`drop_carry_answer`) as their response."""
    rng = random.Random(seed)
    dropped = {i: drop_carry_answer(p) for i, (p, _) in enumerate(pairs)}
    candidates = [i for i, answer in dropped.items() if answer is not None]
    noisy = list(pairs)
    chosen = rng.sample(candidates, round(fraction * len(candidates)))
    for i in chosen:
        noisy[i] = (pairs[i][0], dropped[i])
    return noisy, len(chosen)


def splits_parser(prog: str, description: str, num_train: int, num_test: int,
                  num_test_ood: int) -> argparse.ArgumentParser:
    """The options every generated RL task's ``verl data`` command takes: where, how many of each split, seed."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num-train", type=int, default=num_train)
    parser.add_argument("--num-test", type=int, default=num_test)
    parser.add_argument("--num-test-ood", type=int, default=num_test_ood,
                        help="out-of-form held-out problems written to test_ood.parquet (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``verl data arithmetic --out DIR``: parquet splits + tokenizer. Returns 0."""
    parser = splits_parser("verl data arithmetic", __doc__.splitlines()[0], 4000, 256, 128)
    parser.add_argument("--ops", default="+", help="operators to use, e.g. '+' or '+-'")
    parser.add_argument("--tokenizer-out", default=None, help="tokenizer directory (default: OUT/tokenizer)")
    args = parser.parse_args(argv)

    train, test = generate_problems(args.num_train, args.num_test, args.seed, args.ops)
    ood = generate_out_of_form(args.num_test_ood, args.seed, args.ops) if args.num_test_ood else []
    check_out_dir(args.out)
    write_rl_splits(args.out, make_row, train, test, ood)
    tokenizer_dir = build_char_tokenizer(args.tokenizer_out or os.path.join(args.out, "tokenizer"))
    print(f"arithmetic: {len(train)} train / {len(test)} test / {len(ood)} out-of-form test problems -> {args.out}; "
          f"tokenizer -> {tokenizer_dir}")
    return 0
