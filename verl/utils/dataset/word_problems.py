"""A GSM8K-format task the project generates: short multi-step word problems with small numbers.

``verl data word-problems --out DIR`` writes verl-format ``train.parquet`` / ``test.parquet`` (seeded, disjoint
by computation: no training problem has a held-out problem's template and operands, whatever its name and item)
and ``test_ood.parquet`` (out-of-form held-out problems: reworded templates, names and items no training row
uses; rows marked ``extra_info.out_of_form``). Each row's prompt is one user turn (chat messages, so the model's
own chat template renders it) asking for the answer as ``The answer is N.``; ``reward_model.ground_truth`` is N, and
``extra_info.answer`` is a GSM8K-style worked solution ending in ``#### N``. The scorer is
:mod:`verl.utils.reward_score.word_problems` (data source ``word_problems``).

``--prompt-format fewshot`` writes each prompt as plain text for a base model (no chat template): two worked
training problems as ``Question: ... / Answer: ... The answer is N.``, then the problem and ``Answer:``. A base model
continues a document: asked in one user turn it writes more questions, never ``The answer is N.`` (Gemma 3 270M, 4
samples), while after two shots it answers in that form, often wrongly (``11 - 5 = 8. The answer is 8.``): a signal
RL can use. The 48-token responses of the config end before a second ``The answer is`` would fit.

Sized for a small pretrained chat model: SmolLM2-135M-Instruct answers ~10% of the 64 held-out problems of
seed 0 right greedily (measured on the split before it was drawn by computation; one- and two-step problems,
small operands, answers below 100; most misses answer before working it out or stop after one step), so RL has
room to improve it.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from collections.abc import Callable, Sequence

from verl.utils.dataset.arithmetic import check_out_dir, rl_row, splits_parser, write_rl_splits
from verl.utils.dataset.errors import DatasetError
from verl.utils.reward_score import STOP_KEY

DATA_SOURCE = "word_problems"
INSTRUCTION = 'End with "The answer is N."'
NAMES = (("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Mia", "she"), ("Sam", "he"), ("Lily", "she"),
         ("Leo", "he"), ("Emma", "she"), ("Max", "he"), ("Zoe", "she"))
ITEMS = ("apples", "books", "pens", "cards", "balls", "cookies", "stickers", "marbles", "shells", "stamps")

Bound = int | Callable[[dict], int]  # an operand bound, or a function of the operands drawn before it


@dataclasses.dataclass(frozen=True)
class Template:
    """One kind of problem, as data. ``draws``: its operands, each (name, low, high) drawn with ``rng.randint`` in
    this order (a bound may be a function of the operands drawn before it); ``derive``: the values computed from
    them; ``question`` and ``steps`` (the worked solution, or a calculator expression) are ``str.format`` texts over
    all of those and ``name``, ``he``/``He``, ``item``/``Item`` and ``other`` (another name of ``names``, drawn
    first where the question uses it); ``answer`` names the value that answers it.

    Called as ``template(rng, name, pronoun, item)`` -> (question, steps, answer)."""

    kind: str
    draws: tuple[tuple[str, Bound, Bound], ...]
    question: str
    steps: str
    answer: str
    derive: Callable[[dict], dict] = dict
    names: tuple[tuple[str, str], ...] = NAMES

    @property
    def __name__(self) -> str:
        return self.kind

    def __call__(self, rng: random.Random, name: str, he: str, item: str) -> tuple[str, str, int]:
        values: dict = {"name": name, "he": he, "He": he.capitalize(), "item": item, "Item": item.capitalize()}
        if "{other}" in self.question:
            values["other"] = rng.choice([n for n, _ in self.names if n != name])
        for key, low, high in self.draws:
            values[key] = rng.randint(*(b(values) if callable(b) else b for b in (low, high)))
        values.update(self.derive(values))
        return self.question.format(**values), self.steps.format(**values), values[self.answer]


def _change(v: dict) -> dict:
    cost = v["price"] * v["count"]
    bill = 20 if cost < 20 else 50  # the smallest bill that pays
    return {"cost": cost, "bill": bill, "n": bill - cost}


TEMPLATES: tuple[Template, ...] = (
    Template("gets_more", (("a", 2, 19), ("b", 2, 9)),
             "{name} has {a} {item} and gets {b} more. How many {item} does {he} have now?",
             "{a} + {b} = {n}.", "n", lambda v: {"n": v["a"] + v["b"]}),
    Template("loses_some", (("a", 6, 19), ("b", 2, lambda v: v["a"] - 2)),
             "{name} has {a} {item} and loses {b} of them. How many {item} does {he} have left?",
             "{a} - {b} = {n}.", "n", lambda v: {"n": v["a"] - v["b"]}),
    Template("buy_then_give", (("a", 2, 9), ("b", 2, 9), ("c", 1, lambda v: v["a"] + v["b"] - 1)),
             "{name} has {a} {item}. {He} buys {b} more, then gives away {c}. How many {item} does {he} have now?",
             "{a} + {b} = {ab}. {ab} - {c} = {n}.", "n",
             lambda v: {"ab": v["a"] + v["b"], "n": v["a"] + v["b"] - v["c"]}),
    Template("bags", (("a", 2, 9), ("b", 2, 9)),
             "{name} buys {a} bags with {b} {item} in each bag. How many {item} does {he} have?",
             "{a} * {b} = {n}.", "n", lambda v: {"n": v["a"] * v["b"]}),
    Template("has_and_packs", (("a", 2, 9), ("b", 2, 5), ("c", 2, 9)),
             "{name} has {a} {item} and buys {b} packs of {c} {item}. How many {item} does {he} have now?",
             "{b} * {c} = {bc}. {a} + {bc} = {n}.", "n",
             lambda v: {"bc": v["b"] * v["c"], "n": v["a"] + v["b"] * v["c"]}),
    Template("share", (("each", 2, 9), ("friends", 2, 6)),
             "{name} has {total} {item} and shares them equally among {friends} friends. How many {item} does each "
             "friend get?", "{total} / {friends} = {each}.", "each",
             lambda v: {"total": v["each"] * v["friends"]}),
    Template("more_than", (("a", 2, 9), ("b", 2, 9)),
             "{name} has {a} {item}. {other} has {b} more {item} than {name}. How many {item} do they have together?",
             "{a} + {b} = {ab}. {a} + {ab} = {n}.", "n", lambda v: {"ab": v["a"] + v["b"], "n": 2 * v["a"] + v["b"]}),
    Template("change", (("price", 2, 9), ("count", 2, 5)),
             "{Item} cost {price} dollars each. {name} buys {count} {item} and pays with a {bill} dollar bill. How "
             "many dollars of change does {he} get?",
             "{price} * {count} = {cost}. {bill} - {cost} = {n}.", "n", _change),
    Template("pages", (("per_day", 2, 9), ("days", 2, 5), ("extra", 2, 9)),
             "{name} reads {per_day} pages every day for {days} days, then {extra} more pages. How many pages does "
             "{he} read in total?", "{per_day} * {days} = {read}. {read} + {extra} = {n}.", "n",
             lambda v: {"read": v["per_day"] * v["days"], "n": v["per_day"] * v["days"] + v["extra"]}),
)


# The out-of-form held-out set: the same computations (each template above has a reworded twin, in order) asked
# with names and items no training row uses, in wordings no training row uses.
OOD_NAMES = (("Omar", "he"), ("Nina", "she"), ("Raj", "he"), ("Yuki", "she"), ("Ivan", "he"), ("Sara", "she"))
OOD_ITEMS = ("coins", "stones", "buttons", "ribbons", "crayons", "beads")
_OOD_QUESTIONS = {
    "gets_more": "There are {a} {item} in {name}'s box. A friend puts in {b} more. What is the number of {item} in "
                 "the box now?",
    "loses_some": "{name} started the day with {a} {item}. By evening {b} were lost. What number of {item} remain?",
    "buy_then_give": "{name} owns {a} {item}, then picks up {b} more and hands {c} to a neighbour. What is {name}'s "
                     "count of {item} at the end?",
    "bags": "Every box holds {b} {item}, and {name} fills {a} boxes. What is the total number of {item}?",
    "has_and_packs": "{name} owns {a} loose {item}. Then {he} gets {b} packets, each holding {c} {item}. What is the "
                     "total now?",
    "share": "{total} {item} are split evenly between {friends} children by {name}. What does one child receive?",
    "more_than": "{name} collected {a} {item}, and {other} collected {b} {item} more than {name} did. What is their "
                 "combined total?",
    "change": "One of the {item} sells for {price} dollars. {name} takes {count} of them and hands over {bill} "
              "dollars. What change comes back?",
    "pages": "For {days} days {name} gets through {per_day} pages a day, and afterwards another {extra} pages. What is "
             "the total number of pages?",
}
OOD_TEMPLATES: tuple[Template, ...] = tuple(dataclasses.replace(t, question=_OOD_QUESTIONS[t.kind], names=OOD_NAMES)
                                            for t in TEMPLATES)


def computation_key(template: int, solution: str) -> tuple:
    """What a problem computes: its template (by index; a reworded twin in :data:`OOD_TEMPLATES` has its twin's
    index) and its operands, read from the worked solution (every operand appears in it, in the template's
    order, whatever order the question states them in). The names and items do not count: two questions that
    differ only in them are one computation."""
    return (template, *(int(n) for n in re.findall(r"\d+", solution)))


KINDS = tuple(t.kind for t in TEMPLATES)


def _draw(rng: random.Random, templates: Sequence[Template], names, items,
          kinds: Sequence[int] | None = None) -> tuple[int, tuple[str, str, int]]:
    # ``kinds``: the template indices to draw from (all when None, which keeps every seed's draws as they were).
    index = rng.randrange(len(templates)) if kinds is None else kinds[rng.randrange(len(kinds))]
    name, pronoun = names[rng.randrange(len(names))]
    return index, templates[index](rng, name, pronoun, items[rng.randrange(len(items))])


def make_problem(rng: random.Random) -> tuple[str, str, int]:
    """One (question, worked solution, answer), every choice drawn from ``rng``."""
    return _draw(rng, TEMPLATES, NAMES, ITEMS)[1]


def kind_indices(kinds: Sequence[str] | None) -> tuple[int, ...] | None:
    """The :data:`TEMPLATES` indices of the named kinds (None: every kind). An unknown or repeated name is bad
    input."""
    if kinds is None:
        return None
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds or len(set(kinds)) != len(kinds):
        raise DatasetError(f"word_problems: expected distinct kinds among {', '.join(KINDS)}, found "
                           f"{', '.join(kinds) or 'none'}")
    return tuple(KINDS.index(k) for k in kinds)


def generate_problems(num_train: int, num_test: int, seed: int = 0, num_test_ood: int = 0,
                      kinds: Sequence[str] | None = None) -> tuple[list[tuple[str, str, int]], ...]:
    """(train, test), or (train, test, test_ood) when ``num_test_ood`` > 0, each problem a (question, worked
    solution, answer). Held out means held out: the test split's problems are distinct computations
    (:func:`computation_key`: template and operands) and no training problem computes one of them, whatever
    its name and item; training questions are distinct. The test split is drawn first, so a larger ``num_train``
    never changes the held-out set of a seed. ``test_ood``: distinct computations none of which is in train or
    test, asked in the reworded :data:`OOD_TEMPLATES` with :data:`OOD_NAMES` / :data:`OOD_ITEMS`, which no
    training question uses."""
    if num_train < 1 or num_test < 1 or num_test_ood < 0:
        raise DatasetError(f"word_problems: expected num_train >= 1, num_test >= 1 and num_test_ood >= 0, found "
                           f"num_train={num_train} num_test={num_test} num_test_ood={num_test_ood}")
    indices = kind_indices(kinds)
    rng = random.Random(seed)
    held_out: set[tuple] = set()
    test: list[tuple[str, str, int]] = []
    train: list[tuple[str, str, int]] = []
    seen: set[str] = set()
    # Far more distinct problems exist than any sensible request; the bound only stops a runaway loop.
    attempts, limit = 0, 50 * (num_train + num_test + num_test_ood) + 1000

    def attempt() -> None:
        nonlocal attempts
        attempts += 1
        if attempts > limit:
            raise DatasetError(f"word_problems: could not draw {num_train} train / {num_test} test / "
                               f"{num_test_ood} out-of-form problems disjoint by computation (found {len(train)} / "
                               f"{len(test)} / {len(ood)}); ask for fewer")

    while len(test) < num_test:
        attempt()
        index, problem = _draw(rng, TEMPLATES, NAMES, ITEMS, indices)
        key = computation_key(index, problem[1])
        if key not in held_out:
            held_out.add(key)
            test.append(problem)
    ood: list[tuple[str, str, int]] = []
    # Its own stream: asking for an out-of-form set leaves the test split as it was (train leaves its computations
    # out).
    ood_rng, ood_keys = random.Random(f"word_problems-ood-{seed}"), set()
    while len(ood) < num_test_ood:
        attempt()
        index, problem = _draw(ood_rng, OOD_TEMPLATES, OOD_NAMES, OOD_ITEMS, indices)
        key = computation_key(index, problem[1])
        if key not in held_out and key not in ood_keys:
            ood_keys.add(key)
            ood.append(problem)
    while len(train) < num_train:
        attempt()
        index, problem = _draw(rng, TEMPLATES, NAMES, ITEMS, indices)
        key = computation_key(index, problem[1])
        if key not in held_out and key not in ood_keys and problem[0] not in seen:
            seen.add(problem[0])
            train.append(problem)
    return (train, test, ood) if num_test_ood else (train, test)


PROMPT_FORMATS = ("chat", "fewshot")
FEWSHOT_STOP = "Question:"  # what begins every shot: a completion that writes it has begun another problem


def fewshot_prompt(question: str, shots: Sequence[tuple[str, str, int]]) -> str:
    """A base model's prompt: the worked ``shots`` as Question/Answer pairs, then ``question`` and ``Answer:``."""
    worked = "".join(f"Question: {q}\nAnswer: {solution} The answer is {a}.\n\n" for q, solution, a in shots)
    return f"{worked}Question: {question}\nAnswer:"


def kind_of(question: str) -> str | None:
    """The kind of :data:`TEMPLATES` whose wording ``question`` is (None: none of them, e.g. an out-of-form one)."""
    for template in TEMPLATES:
        pattern = re.escape(template.question)
        pattern = re.sub(r"\\\{\w+\\\}", ".+?", pattern)
        if re.fullmatch(pattern, question):
            return template.kind
    return None


def fewshot_shots(train: Sequence[tuple[str, str, int]], kinds: Sequence[str] | None, num_shots: int = 2) -> tuple:
    """The worked problems before each few-shot prompt: training problems, so the held-out sets stay held out. The
    first ``num_shots``; with ``kinds``, the first training problems of the named kinds taken in turn (two kinds and
    two shots: one of each; one shot: the first kind's), so the prompt decides which operations are shown worked.
    Shown one operation only, the base model copies it into every problem (Gemma 3 270M after a subtraction: "11 - 2
    = 10" for "gets 2 more"); reading the operation from the question is then what RL has to teach."""
    if num_shots < 1:
        raise DatasetError(f"word_problems: expected num_shots >= 1, found {num_shots}")
    if kinds is None:
        return tuple(train[:num_shots])
    by_kind: dict[str | None, list] = {}
    for problem in train:
        by_kind.setdefault(kind_of(problem[0]), []).append(problem)
    shots = []
    for i in range(num_shots):
        kind, turn = kinds[i % len(kinds)], i // len(kinds)
        if len(by_kind.get(kind, ())) <= turn:
            raise DatasetError(f"word_problems: expected {turn + 1} training problem(s) of kind {kind} for the "
                               f"shots, found {len(by_kind.get(kind, ()))}; ask for more training problems")
        shots.append(by_kind[kind][turn])
    return tuple(shots)


def make_row(problem: tuple[str, str, int], split: str, index: int, out_of_form: bool = False,
             shots: Sequence[tuple[str, str, int]] = ()) -> dict:
    """One verl-format row: data_source, prompt, ability, reward_model, extra_info. The prompt is one user turn
    (chat messages) asking for ``The answer is N.``, or with ``shots`` the plain text of :func:`fewshot_prompt`.
    ``out_of_form``: ``extra_info.out_of_form`` is set, and validation reports the row apart
    (``val/accuracy_out_of_form``)."""
    question, solution, answer = problem
    prompt = (fewshot_prompt(question, shots) if shots
              else [{"role": "user", "content": f"{question} {INSTRUCTION}"}])
    # A base model continues the few-shot pattern past its answer with a question of its own and that question's
    # answer; the completion is the text before it (the reward reads extra_info["stop"]).
    stop = {STOP_KEY: [FEWSHOT_STOP]} if shots else {}
    return rl_row(DATA_SOURCE, prompt, answer, split, index, out_of_form, question=question,
                  answer=f"{solution}\n#### {answer}", **stop)


def main(argv: Sequence[str] | None = None) -> int:
    """``verl data word-problems --out DIR``: the parquet splits. Returns 0."""
    parser = splits_parser("verl data word-problems", __doc__.splitlines()[0], 2000, 64, 64)
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="chat",
                        help="chat: one user turn for the model's chat template; fewshot: plain text with two worked "
                             "training problems, for a base model without one")
    parser.add_argument("--num-shots", type=int, default=None,
                        help="fewshot: worked training problems before each prompt, default 2 (with --kinds: the "
                             "named kinds' first problems in turn)")
    parser.add_argument("--kinds", default=None, metavar="KIND,KIND",
                        help=f"draw only these problem kinds (default all: {','.join(KINDS)})")
    args = parser.parse_args(argv)
    if args.num_shots is not None and args.prompt_format != "fewshot":
        raise DatasetError(f"word_problems: expected --num-shots with --prompt-format fewshot (a chat prompt has no "
                           f"worked problems), found it with --prompt-format {args.prompt_format}")
    kinds = args.kinds.split(",") if args.kinds is not None else None
    train, test, *rest = generate_problems(args.num_train, args.num_test, args.seed, args.num_test_ood, kinds)
    ood = rest[0] if rest else []
    check_out_dir(args.out)
    num_shots = 2 if args.num_shots is None else args.num_shots
    shots = fewshot_shots(train, kinds, num_shots) if args.prompt_format == "fewshot" else ()
    write_rl_splits(args.out, functools.partial(make_row, shots=shots), train, test, ood)
    print(f"word_problems: {len(train)} train / {len(test)} test / {len(ood)} out-of-form test problems -> {args.out}")
    return 0
