"""Critic LoRA (verl's critic.model keys; issue 45): the critic worker built from the packaged config with LoRA on
trains the adapters and its value head only (requires_grad and optimizer state), one update moves them and leaves
the base bit-identical, its values at init are the LoRA-off critic's (B = 0), and a save_lora_only checkpoint
resumes to the trained values. FSDP and Megatron, one rank each. The checkpoint's value head is random, so values
at init are not trivially zero."""

import os

import pytest
import torch
from helpers.megatron_tiny_models import RESPONSE, hf_model, padded_batch, save_hf
from helpers.tiny_models import write_arithmetic_data

from verl.launcher.spawn import run_ranks

pytestmark = pytest.mark.distributed
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PPO = os.path.join(REPO, "configs", "ppo_arith_tiny.yaml")
ENGINE = {"fsdp": "model_engine=dp", "megatron": "model_engine=megatron"}
LORA = {"fsdp": ["critic.model.lora_rank=4", "critic.model.lora_alpha=8"],
        "megatron": ["critic.model.lora.rank=4", "critic.model.lora.alpha=8"]}
HEAD = {"fsdp": "score.weight", "megatron": "output_layer.weight"}


def _critic_job(strategy, overrides, checkpoint_dir):
    from verl.engine.lora import adapter_parameters
    from verl.trainer.config import load_config
    from verl.workers.config import CriticConfig
    from verl.workers.critic_worker import CriticWorker, value_loss_fn
    from verl.workers.role_utils import global_batch_info

    def worker(extra):
        config = load_config(PPO, [*overrides, ENGINE[strategy], *extra])
        return CriticWorker(CriticConfig.from_tree(config.critic, "critic"), rollout_n=1, seed=1)

    batch = padded_batch(seed=2, batch=4)
    batch["response_mask"] = batch["attention_mask"][:, -RESPONSE:].float()
    g = torch.Generator().manual_seed(4)
    batch["returns"] = torch.randn(4, RESPONSE, generator=g)
    batch["values"] = torch.randn(4, RESPONSE, generator=g)
    dense = worker([]).critic.compute_values(batch)["values"]
    lora = worker([*LORA[strategy], "critic.checkpoint.save_lora_only=true"])
    engine = lora.critic.engine
    module = engine.module
    full = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()  # noqa: E731
    values = lora.critic.compute_values(batch)["values"]
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    adapters = set(adapter_parameters(module))
    optimizers = engine.torch_optimizers() if strategy == "megatron" else [engine.optimizer]
    optimizer_numel = sum(p.numel() for opt in optimizers for group in opt.param_groups for p in group["params"])
    before = {n: full(p).clone() for n, p in module.named_parameters()}
    counts = global_batch_info(batch["response_mask"], engine.dp_group)
    lora.critic.update_critic(batch, value_loss_fn(lora.config, counts), global_loss=True,
                              summed_metrics=("critic/vf_loss",))
    after = {n: full(p) for n, p in module.named_parameters()}
    # save_lora_only keeps what trains: a fresh LoRA critic resumes to the trained values (value head included).
    trained_values = lora.critic.compute_values(batch)["values"]
    lora.save_checkpoint(checkpoint_dir)
    resumed = worker(LORA[strategy])
    resumed.load_checkpoint(checkpoint_dir)
    resume_err = float((resumed.critic.compute_values(batch)["values"] - trained_values).abs().max())
    return {"init_err": float((values - dense).abs().max()), "values_abs": float(values.abs().max()),
            "trainable": sorted(trainable), "adapters": sorted(adapters),
            "trainable_numel": sum(p.numel() for n, p in module.named_parameters() if n in trainable),
            "optimizer_numel": optimizer_numel, "resume_err": resume_err,
            "lora_only": lora.critic.engine.save_lora_only,
            "moved": sorted(n for n in after if not torch.equal(after[n], before[n]))}


@pytest.fixture(scope="module")
def overrides(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    data = write_arithmetic_data(tmp_path_factory.mktemp("arith"), 80, 8)
    critic_dir = save_hf(hf_model("qwen2_mha_untied", seed=6), str(tmp_path_factory.mktemp("critic")), sharded=False)
    # A trained critic's checkpoint: the LM's body and a random value head (HF's score.weight).
    weights_file = os.path.join(critic_dir, "model.safetensors")
    weights = {k: v for k, v in load_file(weights_file).items() if k != "lm_head.weight"}
    weights["score.weight"] = torch.randn(1, 32, generator=torch.Generator().manual_seed(7))
    save_file(weights, weights_file, metadata={"format": "pt"})
    return [*data, f"critic.model.path={critic_dir}", "trainer.save_freq=-1", "trainer.export_hf_at_end=false",
            "critic.ppo_micro_batch_size_per_gpu=2"]


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_critic_lora_trains_adapters_and_value_head_only(overrides, strategy, tmp_path):
    (r,) = run_ranks(_critic_job, 1, strategy, overrides, str(tmp_path / "ckpt"), timeout_s=240)
    head = HEAD[strategy]
    assert r["adapters"] and all("lora_A" in n or "lora_B" in n for n in r["adapters"]), r
    assert r["trainable"] == sorted(r["adapters"] + [head]), r["trainable"]
    assert r["optimizer_numel"] == r["trainable_numel"], r  # optimizer state for adapters + value head only
    assert r["values_abs"] > 1e-3 and r["init_err"] == 0.0, r  # B = 0: the LoRA-off critic's values exactly
    # One update: A gets no gradient while B = 0, B and the value head move; every base tensor is bit-identical.
    assert head in r["moved"] and any("lora_B" in n for n in r["moved"]), r["moved"]
    assert set(r["moved"]) <= set(r["trainable"]), r["moved"]
    assert r["lora_only"] and r["resume_err"] == 0.0, r


def test_ppo_trains_a_lora_critic_on_fsdp(tmp_path):
    """`verl train` PPO (GAE) with critic.model.lora_rank: both models train, and the critic's save_lora_only
    checkpoint records its LoRA."""
    from helpers.tiny_models import arithmetic_data_args
    from helpers.train_runs import COMMON_KEYS, CRITIC_KEYS, check_step_record, read_metrics, run_train, train_cmd

    out = tmp_path / "run"
    run_train(train_cmd("ppo_arith_tiny.yaml", out, arithmetic_data_args(tmp_path / "data"), "model_engine=dp",
                        "critic.model.lora_rank=4", "critic.checkpoint.save_lora_only=true",
                        "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_freq=2",
                        "trainer.val_before_train=false", "trainer.export_hf_at_end=false"))
    metrics = read_metrics(out)
    for step in (1, 2):
        check_step_record(metrics[step], step, COMMON_KEYS + CRITIC_KEYS)
    assert metrics[2]["critic/grad_norm"] > 0  # step 1's returns are all zero (no reward, no KL yet)
    manifest = (out / "checkpoints" / "global_step_2" / "critic" / "verl_checkpoint.json").read_text()
    assert '"lora_only": true' in manifest and '"rank": 4' in manifest
