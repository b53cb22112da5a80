"""verl's trainer keys in the PPO loop, driven with fake worker groups (no model, no process group):
trainer.critic_warmup, trainer.balance_batch, trainer.rollout_data_dir / validation_data_dir, and the
dataloader's checkpointed position with data.dataloader_num_workers > 0.

The fakes answer every worker-group call from the rows' contents (log-probs, values), and their updates
record what each DP rank would train on: the rows of every mini-batch, cut as the workers cut them (the
batch split into dp contiguous shares, each share into ppo_mini_batch_size * n / dp rows)."""

import json
import os

import numpy as np
import pytest
import torch
from helpers.tiny_models import write_arithmetic_data

from verl.engine.rollout.base import assemble_rollout_batch
from verl.protocol import DataProto
from verl.trainer.config import load_config
from verl.trainer.ppo import trainer as trainer_module

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "configs", "grpo_arith_tiny.yaml")
PPO = os.path.join(REPO, "configs", "ppo_arith_tiny.yaml")
DP = 2  # the fake DP size the trainer balances for (its process sees world size 1)


@pytest.fixture(scope="module")
def data_args(tmp_path_factory):
    return write_arithmetic_data(tmp_path_factory.mktemp("arith"), 40, 6)


def small(kind):
    """Batch sizes for 8 prompts a step on DP=2 (TP=1)."""
    common = ["data.train_batch_size=8", "data.val_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", "trainer.logger=[console]",
              "trainer.val_before_train=false", "trainer.export_hf_at_end=false", "trainer.resume_mode=disable",
              "data.dataloader_num_workers=0"]
    if kind == "ppo":  # n = 1: mini-batches of 2 rows per rank
        return common + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_mini_batch_size=4",
                         "critic.ppo_micro_batch_size_per_gpu=2",
                         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]
    return common + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",  # n = 8: 16 rows per rank
                     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
                     "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32"]


class FakeWorkers:
    """The actor/rollout/ref and critic worker groups: deterministic per-row answers, recorded updates."""

    def __init__(self, config, tokenizer):
        self.config, self.tokenizer = config, tokenizer
        self.updates = []  # (role, batch, [set of row ids per mini-batch])
        self.digits = tokenizer.convert_tokens_to_ids(list("0123456789"))

    def update_weights(self):
        return {"perf/reshard_bytes": 0.0}

    def generate_sequences(self, gen):
        cfg = self.config.actor_rollout_ref.rollout
        n = cfg.val_kwargs.n if gen.meta_info.get("validate") else cfg.n
        rows, width = len(gen) * n, self.config.data.max_response_length
        g = torch.Generator().manual_seed(int(gen.meta_info["seed"]))
        # Longer responses in the first half of the batch (DP rank 0's share before balancing).
        lengths = torch.randint(1, width // 2 + 1, (rows,), generator=g) + (torch.arange(rows) < rows // 2) * width // 2
        response_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        digits = torch.tensor(self.digits)[torch.randint(0, 10, (rows, width), generator=g)]
        responses = torch.where(response_mask.bool(), digits, torch.full_like(digits, self.tokenizer.pad_token_id))
        # The rollout's log-probs are the actor's (compute_log_prob's), as after a correct weight sync.
        out = assemble_rollout_batch(gen.batch["input_ids"].repeat_interleave(n, 0),
                                     gen.batch["attention_mask"].repeat_interleave(n, 0), responses, response_mask,
                                     -(responses.float() % 5 + 1) / 10)
        non_tensor = {k: np.repeat(v, n, axis=0) for k, v in gen.non_tensor_batch.items()}
        non_tensor["row"] = np.array([f"{gen.meta_info['seed']}-{i}" for i in range(rows)], dtype=object)
        return DataProto.from_dict(out, non_tensor, {"metrics": {}})

    def compute_log_prob(self, data):
        r = data.batch["responses"].float()
        return DataProto.from_dict({"old_log_probs": -(r % 5 + 1) / 10, "entropys": r % 3 / 10})

    def compute_ref_log_prob(self, data):
        return DataProto.from_dict({"ref_log_prob": -(data.batch["responses"].float() % 7 + 1) / 10})

    def compute_values(self, data):
        return DataProto.from_dict({"values": data.batch["responses"].float() % 4 / 4})

    def _update(self, role, data, section):
        per_rank = section.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n // DP
        mini_batches = {}
        for share in data.chunk(DP):
            for k, start in enumerate(range(0, len(share), per_rank)):
                mini_batches.setdefault(k, set()).update(share.non_tensor_batch["row"][start:start + per_rank])
        self.updates.append((role, data, [mini_batches[k] for k in sorted(mini_batches)]))
        return DataProto(meta_info={"metrics": {f"{role}/fake_loss": float(data.batch["advantages"].sum())}})

    def update_actor(self, data):
        return self._update("actor", data, self.config.actor_rollout_ref.actor)

    def update_critic(self, data):
        return self._update("critic", data, self.config.critic)

    def save_checkpoint(self, path):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "weights.bin"), "w") as fh:
            fh.write("w")

    def load_checkpoint(self, path):
        return 0


def make_trainer(monkeypatch, config_path, overrides, data_args):
    from transformers import AutoTokenizer

    config = load_config(config_path, data_args + overrides)
    tokenizer = AutoTokenizer.from_pretrained(config.data.tokenizer)
    fakes = FakeWorkers(config, tokenizer)
    monkeypatch.setattr(trainer_module, "WorkerGroup", lambda cls, *args, name, **kwargs: fakes)
    trainer = trainer_module.PPOTrainer(config, tokenizer)
    trainer.ppo_step.dp_size, trainer.ppo_step.balance_block = trainer_module.balance_layout(config, DP)
    return trainer, fakes


def first_batch(trainer):
    return next(iter(trainer.train_dataloader))


# ----------------------------------------------------------------------------- critic_warmup
def test_critic_warmup_skips_the_actor_update_until_its_step_as_verl(monkeypatch, data_args, tmp_path):
    trainer, fakes = make_trainer(monkeypatch, PPO, small("ppo") + ["trainer.critic_warmup=2",
                                                                    f"trainer.output_dir={tmp_path}"], data_args)
    batch = first_batch(trainer)
    logged = []
    for step in (1, 2, 3):
        fakes.updates.clear()
        metrics = trainer.train_step(batch, step)
        logged.append(([role for role, *_ in fakes.updates], "actor/fake_loss" in metrics,
                       "timing_s/update_actor" in metrics, "critic/fake_loss" in metrics))
    # verl: `if critic_warmup <= global_steps` with steps counted from 1: step 1 trains only the critic.
    assert logged == [(["critic"], False, False, True), (["critic", "actor"], True, True, True),
                      (["critic", "actor"], True, True, True)]


# ----------------------------------------------------------------------------- balance_batch
def _by_row(data):
    """Every field of the updated batch, rows sorted by their id: equal for a permutation of the same rows."""
    order = np.argsort(data.non_tensor_batch["row"], kind="stable")
    tensors = {k: v[torch.as_tensor(order)] for k, v in data.batch.items()}
    return tensors, {k: list(v[order]) for k, v in data.non_tensor_batch.items()}


def _rank_tokens(data):
    return [int(share.batch["attention_mask"].sum()) for share in data.chunk(DP)]


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_balance_batch_reorders_rows_between_ranks_and_keeps_every_mini_batch(monkeypatch, data_args, tmp_path, kind):
    config_path = PPO if kind == "ppo" else GRPO
    runs = {}
    for balance in (False, True):
        trainer, fakes = make_trainer(monkeypatch, config_path, small(kind) + [
            f"trainer.balance_batch={str(balance).lower()}", f"trainer.output_dir={tmp_path / str(balance)}"],
            data_args)
        metrics = trainer.train_step(first_batch(trainer), 1)
        runs[balance] = (metrics, {role: (data, minis) for role, data, minis in fakes.updates})
    (plain_metrics, plain), (metrics, balanced) = runs[False], runs[True]
    assert set(plain) == set(balanced) == ({"actor", "critic"} if kind == "ppo" else {"actor"})
    for role in plain:
        (plain_data, plain_minis), (data, minis) = plain[role], balanced[role]
        assert minis == plain_minis, f"{role}: a mini-batch changed its rows"
        (plain_tensors, plain_objects), (tensors, objects) = _by_row(plain_data), _by_row(data)
        assert objects == plain_objects
        for key in plain_tensors:  # the same rows with the same advantages, returns, log-probs...
            assert torch.allclose(tensors[key].double(), plain_tensors[key].double(), rtol=0, atol=1e-6), key
        assert not np.array_equal(data.non_tensor_batch["row"], plain_data.non_tensor_batch["row"]), \
            "nothing was reordered: the test would not see a wrong reorder"
        before, after = _rank_tokens(plain_data), _rank_tokens(data)
        assert max(after) - min(after) < max(before) - min(before)
    for key in ("critic/score/mean", "critic/advantages/mean", "response_length/mean", "actor/entropy"):
        assert metrics[key] == pytest.approx(plain_metrics[key], abs=1e-6), key
    assert metrics["global_seqlen/min"] == min(before) and metrics["global_seqlen/max"] == max(before)
    assert metrics["global_seqlen/minmax_diff"] == max(before) - min(before)
    assert (metrics["global_seqlen/balanced_min"], metrics["global_seqlen/balanced_max"]) == (min(after), max(after))
    assert metrics["global_seqlen/mean"] == sum(after) / DP
    assert "global_seqlen/mean" not in plain_metrics


# ----------------------------------------------------------------------------- generation dumps
def test_rollout_and_validation_generations_are_dumped_as_verl_jsonl(monkeypatch, data_args, tmp_path):
    trainer, fakes = make_trainer(monkeypatch, GRPO, small("grpo") + [
        f"trainer.rollout_data_dir={tmp_path / 'rollout'}", f"trainer.validation_data_dir={tmp_path / 'val'}",
        f"trainer.output_dir={tmp_path}"], data_args)
    batch = first_batch(trainer)
    trainer.train_step(batch, 1)
    lines = (tmp_path / "rollout" / "1.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 8 * 8
    assert set(records[0]) == {"input", "output", "gts", "score", "step"}
    updated = fakes.updates[-1][1]  # the step's batch, in the (balanced) order it was dumped
    for i, record in enumerate(records):
        assert record["step"] == 1
        assert record["gts"] == updated.non_tensor_batch["reward_model"][i]["ground_truth"]
        assert record["score"] == pytest.approx(float(updated.batch["token_level_scores"][i].sum()))
        length = int(updated.batch["response_mask"][i].sum())
        assert record["output"] == trainer.tokenizer.decode(updated.batch["responses"][i, :length])
        assert record["input"].endswith("=") and "<" not in record["input"]  # the prompt text, no padding
    prompts = {trainer.tokenizer.decode(ids, skip_special_tokens=True) for ids in batch["raw_prompt_ids"]}
    assert {r["input"] for r in records} == prompts

    trainer.global_step = 3
    trainer.validate()
    val = [json.loads(line) for line in (tmp_path / "val" / "3.jsonl").read_text().splitlines()]
    assert len(val) == 6 and {r["step"] for r in val} == {3}
    assert sorted(r["gts"] for r in val) == sorted(row["reward_model"]["ground_truth"]
                                                    for row in trainer.val_dataloader.dataset.rows)


# ----------------------------------------------------------------------------- dataloader workers
def _run_fit(monkeypatch, data_args, output_dir, steps, workers, resume):
    trainer, _ = make_trainer(monkeypatch, GRPO, small("grpo") + [
        f"trainer.total_training_steps={steps}", "trainer.save_freq=100", f"data.dataloader_num_workers={workers}",
        f"trainer.output_dir={output_dir}", f"trainer.resume_mode={'auto' if resume else 'disable'}",
        "trainer.test_freq=-1"], data_args)
    seen = []
    trainer.train_step = lambda batch_dict, step: seen.append((step, list(batch_dict["index"]))) or {}
    assert trainer.fit() == 0
    return trainer, seen


@pytest.mark.parametrize("stop", [3, 5])  # mid-epoch, and the last batch of the epoch (40 rows / 8)
def test_resume_with_dataloader_workers_continues_with_the_next_unconsumed_batch(monkeypatch, data_args, tmp_path,
                                                                                  stop):
    full_trainer, full = _run_fit(monkeypatch, data_args, tmp_path / "full", 8, workers=2, resume=False)
    assert full_trainer.train_dataloader.num_workers == 2
    _, first = _run_fit(monkeypatch, data_args, tmp_path / "cut", stop, workers=2, resume=False)
    state = json.loads((tmp_path / "cut" / "checkpoints" / f"global_step_{stop}" / "trainer_state.json").read_text())
    assert (state["sampler"]["epoch"], state["sampler"]["position"]) == (0, stop * 8)
    _, rest = _run_fit(monkeypatch, data_args, tmp_path / "cut", 8, workers=2, resume=True)
    assert first + rest == full
    assert len({tuple(ids) for _, ids in full[:5]}) == 5  # five different batches in the first epoch


# ----------------------------------------------------------------------------- batch sources
def test_a_batch_source_supplies_the_steps_and_checkpoints_its_state(monkeypatch, data_args, tmp_path):
    from verl.trainer.ppo.batch_source import SyncBatchSource

    calls = []

    class Recording(SyncBatchSource):
        def start(self, global_step):
            calls.append(("start", global_step))

        def trained(self, generated, batch):
            calls.append(("trained", len(batch), generated.on_policy))

        def end_step(self, step, metrics, trained):
            calls.append(("end_step", step))
            return super().end_step(step, metrics, trained)

        def state_dict(self):
            return {**super().state_dict(), "recording": len(calls)}

        def load_state_dict(self, state):
            calls.append(("load", state["recording"], int(state["step"])))
            super().load_state_dict(state)

    monkeypatch.setattr(trainer_module.PPOTrainer, "batch_source_class", Recording)

    def fit(steps, resume):
        trainer, _ = make_trainer(monkeypatch, GRPO, small("grpo") + [
            f"trainer.total_training_steps={steps}", "trainer.save_freq=100", f"trainer.output_dir={tmp_path}",
            f"trainer.resume_mode={'auto' if resume else 'disable'}", "trainer.test_freq=-1"], data_args)
        assert isinstance(trainer.source, Recording) and trainer.fit() == 0

    fit(2, resume=False)
    assert calls == [("start", 0), ("trained", 64, True), ("end_step", 1), ("trained", 64, True), ("end_step", 2)]
    state = json.loads((tmp_path / "checkpoints" / "global_step_2" / "trainer_state.json").read_text())
    assert state["recording"] == 5 and (state["sampler"]["epoch"], state["sampler"]["position"]) == (0, 16)
    calls.clear()
    fit(3, resume=True)
    assert calls == [("load", 5, 2), ("start", 2), ("trained", 64, True), ("end_step", 3)]


def test_async_trainers_differ_from_the_sync_trainer_only_by_their_batch_source():
    from verl.trainer.v1.colocate_async import ColocateAsyncTrainer, ReplayBufferSource
    from verl.trainer.v1.separate_async import PoolSource, SeparateAsyncTrainer

    for cls, source in ((ColocateAsyncTrainer, ReplayBufferSource), (SeparateAsyncTrainer, PoolSource)):
        assert cls.__bases__ == (trainer_module.PPOTrainer,)
        assert {name for name in vars(cls) if not name.startswith("__")} == {"batch_source_class"}
        assert cls.batch_source_class is source and source.off_policy


# ----------------------------------------------------------------------------- metrics vs checkpoints
def test_a_step_checkpointed_but_never_logged_is_logged_from_its_checkpoint_on_resume(monkeypatch, data_args,
                                                                                      tmp_path):
    from verl.utils.tracking import read_metrics

    def fit(steps, resume, fail_logging_at=None):
        trainer, _ = make_trainer(monkeypatch, GRPO, small("grpo") + [
            f"trainer.total_training_steps={steps}", "trainer.save_freq=2", f"trainer.output_dir={tmp_path}",
            f"trainer.resume_mode={'auto' if resume else 'disable'}", "trainer.test_freq=-1",
            "trainer.val_before_train=false"], data_args)
        trainer.train_step = lambda batch_dict, step: {"critic/score/mean": 0.25 * step}
        if fail_logging_at is not None:
            log = trainer._log

            def failing_log(metrics, step):
                if step == fail_logging_at:
                    raise OSError(28, "No space left on device")  # after step 2's checkpoint was saved
                log(metrics, step)
            trainer._log = failing_log
        return trainer.fit()

    with pytest.raises(OSError):
        fit(3, resume=False, fail_logging_at=2)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1]
    assert fit(3, resume=True) == 0
    records = {r["step"]: r for r in read_metrics(str(tmp_path))}
    assert sorted(records) == [1, 2, 3] and records[2]["critic/score/mean"] == 0.5
