"""The PPO trainer is one class over parts, each part built with what it reads (issue 54, item 6): no mixin stack,
and no part or batch source reaches into the trainer or into another object's private members."""

import ast
import glob
import os

from verl.trainer.ppo.trainer import PPOTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARTS = sorted(glob.glob(os.path.join(ROOT, "verl/trainer/ppo/*.py")) +
               glob.glob(os.path.join(ROOT, "verl/trainer/v1/*.py")))


def test_the_trainer_is_one_class_not_a_mixin_stack():
    from verl.trainer.v1.colocate_async import ColocateAsyncTrainer
    from verl.trainer.v1.separate_async import SeparateAsyncTrainer

    assert PPOTrainer.__bases__ == (object,)
    assert ColocateAsyncTrainer.__bases__ == SeparateAsyncTrainer.__bases__ == (PPOTrainer,)


def reaches(path: str) -> list[str]:
    """Where a module of the trainer's parts reads another object's private member, takes a ``trainer`` argument or
    keeps one (``self.trainer``)."""
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        where = f"{os.path.relpath(path, ROOT)}:{getattr(node, 'lineno', '?')}"
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{where} {ast.unparse(node)}")
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found += [f"{where} {node.name}(trainer)" for a in node.args.args + node.args.kwonlyargs
                      if a.arg == "trainer"]
        if (isinstance(node, ast.Attribute) and node.attr == "trainer" and isinstance(node.value, ast.Name)
                and node.value.id == "self"):
            found.append(f"{where} self.trainer")
    return found


def test_no_part_or_batch_source_reads_the_trainer_or_another_objects_private_members():
    assert len(PARTS) > 15
    assert [hit for path in PARTS for hit in reaches(path)] == []


def test_the_scan_finds_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("class Source:\n    def __init__(self, trainer):\n        self.trainer = trainer\n\n"
                   "    def go(self):\n        return self.trainer._timer('gen'), other._probs_checked\n")
    hits = sorted(hit.split(" ", 1)[1] for hit in reaches(str(bad)))
    assert hits == ["__init__(trainer)", "other._probs_checked", "self.trainer", "self.trainer",
                    "self.trainer._timer"], hits
