"""Reward model worker, actor temperature and HF export on 2 gloo ranks at Megatron TP=2.

One spawned job (TP=2, DP=1) runs all three; single-process transformers is the oracle:
- ``RewardModelWorker.compute_rm_score`` equals the HF reward model's score head at the last valid
  token, placed on the last valid response token; ``swap_reward_model`` to another checkpoint gives
  that checkpoint's scores;
- ``Actor.compute_log_prob(temperature=0.7)`` recomputes the native rollout's
  ``rollout_log_probs`` of responses sampled at temperature 0.7 (and temperature 1 does not);
- ``export_actor_hf`` of a perturbed actor writes a directory transformers loads, whose logits equal
  the Megatron actor's.
"""

import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import VOCAB, hf_model  # noqa: E402
from helpers.tolerance import log_prob_tolerance, logits_tolerance  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402

TEMPERATURE = 0.7
PROMPT, RESPONSE = 6, 5


# Megatron against transformers: the same weights, another fp32 summation order. The reward models have 2
# decoder layers, the language model 4; the widest reduction of both is the MLP's (64 terms). Scores and logits
# here are below 1 while the normalised activations feeding every projection are of magnitude 1.
RM_TOL = logits_tolerance(torch.float32, width=64, num_layers=2)
LM_TOL = logits_tolerance(torch.float32, width=64, num_layers=4)
LOG_PROB_TOL = log_prob_tolerance(torch.float32, width=64, num_layers=4, vocab=VOCAB)


def rm_batch():
    """Rollout-shaped rows: left-padded prompts, right-padded responses (one empty)."""
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(3, VOCAB, (4, PROMPT + RESPONSE), generator=generator)
    prompt_pad, response_len = [0, 2, 4, 1], [5, 3, 1, 0]
    attention_mask = torch.zeros_like(input_ids)
    for row in range(4):
        attention_mask[row, prompt_pad[row]:PROMPT + response_len[row]] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "responses": input_ids[:, PROMPT:]}


def save_reward_model(path, seed):
    """A tiny random Qwen2 sequence-classification model (score.weight [1, hidden])."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      num_labels=1, pad_token_id=0, initializer_range=0.3,
                                      attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.Qwen2ForSequenceClassification(config).eval()
    model.save_pretrained(path)
    return model


def reference_rm_scores(model, batch):
    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"]).last_hidden_state
        per_token = model.score(hidden)[..., 0]
    out = torch.zeros(len(per_token), RESPONSE)
    for row in range(len(per_token)):
        n = int(batch["attention_mask"][row, PROMPT:].sum())
        if n:
            out[row, n - 1] = per_token[row, PROMPT + n - 1]
    return out


def _job(lm_dir, rm_a, rm_b, export_dir, batch):
    from verl.engine.megatron.engine import MegatronEngine
    from verl.engine.megatron.parallel import initialize_megatron
    from verl.engine.padding import restore
    from verl.engine.roles import Actor
    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.native.engine import NativeRollout
    from verl.models.config import ModelConfig
    from verl.models.hf_export import export_actor_hf
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model
    from verl.protocol import DataProto
    from verl.single_controller import WorkerGroup
    from verl.trainer.config import load_config
    from verl.workers.config import ActorConfig, RewardModelConfig
    from verl.workers.reward_model_worker import RewardModelWorker

    initialize_megatron(2, 1, seed=1)
    result = {}

    # Reward model: scores, then a hot swap. Its section and the actor's (whose layout it follows) as the
    # trainer builds them from the packaged defaults.
    config = load_config(None, [f"reward_model.model.path={rm_a}", "reward_model.micro_batch_size_per_gpu=2",
                                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                "actor_rollout_ref.actor.megatron.seed=1", "trainer.n_gpus_per_node=2",
                                "trainer.seed=0"], resolve_only=True)
    rm_wg = WorkerGroup(RewardModelWorker, RewardModelConfig.from_tree(config.reward_model, "reward_model"),
                        layout_role=ActorConfig.from_tree(config.actor_rollout_ref.actor, "actor_rollout_ref.actor"),
                        seed=config.trainer.seed, name="reward_model")
    result["rm_a"] = rm_wg.compute_rm_score(DataProto.from_dict(batch)).batch["rm_scores"]
    rm_wg.swap_reward_model(rm_b)
    result["rm_b"] = rm_wg.compute_rm_score(DataProto.from_dict(batch)).batch["rm_scores"]

    # Temperature: the rollout samples at 0.7, the TP=2 actor recomputes.
    lm_config = ModelConfig.from_pretrained(lm_dir)
    engine = MegatronEngine(lm_config, optim=None)
    load_hf_into_model(engine.module, lm_config, HFCheckpoint(lm_dir).get)
    actor = Actor(engine, micro_batch_size=2)
    rollout = NativeRollout(lm_config)
    rollout.load_hf_checkpoint(lm_dir)
    prompts = batch["input_ids"][:, :PROMPT]
    prompt_mask = batch["attention_mask"][:, :PROMPT]
    out = rollout.generate(prompts, prompt_mask, SamplingParams(temperature=TEMPERATURE, response_length=RESPONSE,
                                                                seed=11, n=2))
    fields = {k: out[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    result["response_mask"] = out["response_mask"]
    result["rollout_log_probs"] = out["rollout_log_probs"]
    result["log_probs_t"] = actor.compute_log_prob(fields, calculate_entropy=False,
                                                   temperature=TEMPERATURE)["log_probs"]
    result["log_probs_1"] = actor.compute_log_prob(fields, calculate_entropy=False)["log_probs"]

    # HF export of a perturbed actor (seeded by name: replicated tensors stay equal across TP ranks).
    with torch.no_grad():
        for name, param in engine.module.named_parameters():
            generator = torch.Generator().manual_seed(sum(map(ord, name)))
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    export_actor_hf(engine, lm_config, lm_dir, export_dir, tokenizer=None)

    def full_logits(logits, aligned_ids, shifts, micro_batch):
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        return {"logits": restore(gather_from_tensor_model_parallel_region(logits)[..., :VOCAB], shifts)}

    result["megatron_logits"] = engine.forward(batch, 2, full_logits)["logits"]
    return result


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_temp_export")
    lm_dir = str(root / "lm")
    hf_model("qwen2_gqa_tied").save_pretrained(lm_dir)
    models = {name: save_reward_model(str(root / name), seed) for name, seed in (("rm_a", 0), ("rm_b", 1))}
    batch = rm_batch()
    result = run_ranks(_job, 2, lm_dir, str(root / "rm_a"), str(root / "rm_b"), str(root / "actor_hf"), batch,
                       timeout_s=240)
    return {"ranks": result, "models": models, "batch": batch, "export_dir": root / "actor_hf"}


def test_reward_model_scores_equal_hf_reference_at_last_response_token(job):
    expected = reference_rm_scores(job["models"]["rm_a"], job["batch"])
    for rank in job["ranks"]:
        assert rank["rm_a"].shape == (4, RESPONSE)
        torch.testing.assert_close(rank["rm_a"], expected, atol=RM_TOL, rtol=0)
    assert torch.all(expected[3] == 0)  # the empty response carries no score
    assert torch.all(expected[:3].abs().sum(-1) > 0)


def test_reward_model_hot_swap_gives_the_new_checkpoints_scores(job):
    expected = reference_rm_scores(job["models"]["rm_b"], job["batch"])
    for rank in job["ranks"]:
        torch.testing.assert_close(rank["rm_b"], expected, atol=RM_TOL, rtol=0)
        assert (rank["rm_b"] - rank["rm_a"]).abs().max() > 1e-2


def test_actor_log_probs_at_rollout_temperature_equal_rollout_log_probs(job):
    for rank in job["ranks"]:
        mask = rank["response_mask"].bool()
        assert mask.sum() > 0
        diff = (rank["log_probs_t"] - rank["rollout_log_probs"]).abs()[mask]
        assert diff.max() <= LOG_PROB_TOL, diff.max()
        # Without the temperature the actor would disagree with the rollout.
        assert (rank["log_probs_1"] - rank["rollout_log_probs"]).abs()[mask].max() > 1e-2


def test_hf_export_loads_in_transformers_with_the_megatron_logits(job):
    import transformers

    export_dir = job["export_dir"]
    assert sorted(os.listdir(export_dir.parent)).count("actor_hf.tmp") == 0
    assert {"config.json", "model.safetensors", "generation_config.json"} <= set(os.listdir(export_dir))
    assert json.loads((export_dir / "config.json").read_text())["torch_dtype"] == "float32"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export_dir), attn_implementation="eager").eval()
    batch = job["batch"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    valid = batch["attention_mask"].bool()
    megatron = job["ranks"][0]["megatron_logits"]
    torch.testing.assert_close(megatron[valid], logits[valid], atol=LM_TOL, rtol=0)
    # The export is the perturbed actor, not the checkpoint it started from.
    original = transformers.AutoModelForCausalLM.from_pretrained(
        str(export_dir.parent / "lm"), attn_implementation="eager").eval()
    with torch.no_grad():
        before = original(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          position_ids=batch["position_ids"]).logits
    assert (before[valid] - logits[valid]).abs().max() > 1e-2
