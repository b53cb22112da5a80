"""Classifier reward models with their own tokenizer through the reward model worker on 2 FSDP ranks (issue 47,
item 1): Llama and Qwen2 ``*ForSequenceClassification`` on the FSDP engine, BERT and DeBERTa-v2 as transformers'
replicated forward, one hot swap after another; each row's score equals transformers' own forward of the decoded
conversation and sits on the last valid response token of the actor's layout."""

import pytest
import torch
from helpers.reward_models import FAMILIES, hf_score, save_reward_model
from helpers.tiny_models import write_arithmetic_data

from verl.launcher.spawn import run_ranks

PROMPTS = ["12+3=", "7*8=", "(100-1)/9=", "5-5="]
RESPONSES = ["15", "56", "", "0"]
PROMPT_LEN, RESPONSE_LEN = 12, 4


def actor_batch(tokenizer):
    rows = len(PROMPTS)
    ids = torch.full((rows, PROMPT_LEN + RESPONSE_LEN), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(r, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if r else [])
        ids[i, PROMPT_LEN - len(p_ids):PROMPT_LEN] = torch.tensor(p_ids)
        mask[i, PROMPT_LEN - len(p_ids):PROMPT_LEN] = 1
        if r_ids:
            ids[i, PROMPT_LEN:PROMPT_LEN + len(r_ids)] = torch.tensor(r_ids)
            mask[i, PROMPT_LEN:PROMPT_LEN + len(r_ids)] = 1
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids, "responses": ids[:, PROMPT_LEN:]}


def _job(paths, actor_tokenizer, batch):
    from verl.protocol import DataProto
    from verl.single_controller import WorkerGroup
    from verl.trainer.config import load_config
    from verl.workers.config import ActorConfig, RewardModelConfig
    from verl.workers.reward_model_worker import RewardModelWorker

    config = load_config(None, [f"reward_model.model.path={paths[0]}", "reward_model.micro_batch_size_per_gpu=1",
                                f"reward_model.model.input_tokenizer={actor_tokenizer}",
                                "actor_rollout_ref.actor.strategy=fsdp", "trainer.n_gpus_per_node=2"],
                         resolve_only=True)
    rm_wg = WorkerGroup(RewardModelWorker, RewardModelConfig.from_tree(config.reward_model, "reward_model"),
                        layout_role=ActorConfig.from_tree(config.actor_rollout_ref.actor, "actor_rollout_ref.actor"),
                        seed=0, name="reward_model")
    out = {}
    for i, path in enumerate(paths):
        if i:
            rm_wg.swap_reward_model(path)
        scored = rm_wg.compute_rm_score(DataProto.from_dict(batch))
        out[path] = (scored.batch["rm_scores"], scored.meta_info["metrics"]["reward_model/truncated_frac"])
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from verl.workers.reward_model.plan import load_tokenizer

    root = tmp_path_factory.mktemp("rm_tokenizer")
    (root / "arith").mkdir()
    data_args = write_arithmetic_data(root / "arith", 8, 2)
    actor_tokenizer = data_args[-1].split("=", 1)[1]
    models = {family: save_reward_model(str(root / family), family, seed=i) for i, family in enumerate(FAMILIES)}
    batch = actor_batch(load_tokenizer(actor_tokenizer, "data.tokenizer"))
    paths = [str(root / family) for family in FAMILIES]
    ranks = run_ranks(_job, 2, paths, actor_tokenizer, batch, timeout_s=240)
    return {"ranks": ranks, "models": models, "root": root, "batch": batch}


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_equal_transformers_forward_on_the_last_response_token(job, family):
    from verl.workers.reward_model.plan import load_tokenizer

    path = str(job["root"] / family)
    rm_tok = load_tokenizer(path, "rm")
    expected = torch.zeros(len(PROMPTS), RESPONSE_LEN)
    response_lengths = job["batch"]["attention_mask"][:, PROMPT_LEN:].sum(1).tolist()
    for row, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        if response_lengths[row]:
            expected[row, response_lengths[row] - 1] = hf_score(job["models"][family], rm_tok, p, r, family)
    for rank in job["ranks"]:
        scores, truncated_frac = rank[path]
        torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)
        assert list(truncated_frac) == [0.0, 0.0]  # one per DP replica (the trainer averages them)
