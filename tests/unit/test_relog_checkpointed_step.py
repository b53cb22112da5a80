"""A step whose checkpoint was saved but whose log line never reached metrics.jsonl (the run died in between) is
logged on resume from the metrics its checkpoint carries: exactly once, and never a second time for a step the
file has already."""

import json
from types import SimpleNamespace

from verl.trainer.ppo.context import PhaseTimer
from verl.trainer.ppo.trainer import PPOTrainer
from verl.utils import checkpoint as ckpt
from verl.utils.tracking import Tracking


class Resumed(PPOTrainer):
    """What _relog_checkpointed_step reads of a trainer after load_checkpoint (rank 0, no timeline)."""

    def __init__(self, output_dir, checkpoint):
        state = ckpt.load_trainer_state(checkpoint)
        self.global_step, self._resumed_step_metrics = int(state["step"]), state.get("step_metrics") or {}
        self.rank, self.total_training_steps = 0, 5
        self.sections = SimpleNamespace(trainer=SimpleNamespace(output_dir=output_dir))
        self.tracking = Tracking(output_dir, backends=())
        self.printed = []
        self._print = self.printed.append
        self.timer = PhaseTimer(self._print)


def logged_steps(output_dir):
    with open(output_dir / "metrics.jsonl", encoding="utf-8") as fh:
        return [json.loads(line)["step"] for line in fh]


def run_until(output_dir, steps):
    tracking = Tracking(str(output_dir), backends=())
    for step in steps:
        tracking.log({"actor/pg_loss": float(step)}, step)
    tracking.close()


def checkpoint_of(root, step):
    def save_models(staging):
        pass
    return ckpt.save_trainer_checkpoint(str(root), step, {"step_metrics": {"actor/pg_loss": 0.25}}, save_models)


def test_a_checkpointed_step_missing_from_metrics_jsonl_is_logged_once(tmp_path):
    out = tmp_path / "out"
    run_until(out, [1, 2])  # step 3 was checkpointed, then the run died before its log line
    loop = Resumed(str(out), checkpoint_of(tmp_path / "ckpt", 3))
    loop._relog_checkpointed_step()
    loop.tracking.close()
    assert logged_steps(out) == [1, 2, 3]
    with open(out / "metrics.jsonl", encoding="utf-8") as fh:
        assert json.loads(fh.readlines()[-1])["actor/pg_loss"] == 0.25  # the checkpoint's metrics
    assert any("step 3's metrics were not logged" in line for line in loop.printed), loop.printed
    again = Resumed(str(out), str(tmp_path / "ckpt" / "global_step_3"))  # resumed once more from the same step
    again._relog_checkpointed_step()
    again.tracking.close()
    assert logged_steps(out) == [1, 2, 3]


def test_a_step_already_logged_is_not_logged_twice(tmp_path):
    out = tmp_path / "out"
    run_until(out, [1, 2, 3])
    loop = Resumed(str(out), checkpoint_of(tmp_path / "ckpt", 3))
    loop._relog_checkpointed_step()
    loop.tracking.close()
    assert logged_steps(out) == [1, 2, 3] and loop.printed == []
