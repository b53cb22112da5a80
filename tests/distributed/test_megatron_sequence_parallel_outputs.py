"""Every Megatron output function under sequence parallelism (issue 27): on 4 gloo ranks, the same weights at
TP1 (DP4), TP2 + sequence parallel (DP2) and TP2 + sequence parallel + PP2 give the same

- actor log-probs and entropy (vocab-parallel lm head),
- critic values, and after one critic step its loss, the value head's gradient and the gradient norm, with
  the value head's TP replicas still equal,
- reward-model scores,

and the critic's values at TP1 are the HF trunk's final hidden states times the value head. The batch is
11 columns wide, odd, so sequence parallelism must run past the padded width (12 columns: each TP rank
holds an equal part) and cut the extra column off again; its second micro-batch needs only 10 columns.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import RESPONSE, hf_model, model_config, padded_batch, save_hf  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402

MODEL = "qwen2_gqa_tied"  # qkv bias, GQA, tied embeddings: the lm head's hardest layout under PP
WIDTH = 11
# name -> (tp, pp, sequence_parallel)
LAYOUTS = {"tp1": (1, 1, False), "tp2_sp": (2, 1, True), "tp2_sp_pp2": (2, 2, True)}

# Tolerances. A sum of K fp32 terms taken in another order (TP splits the row-parallel layers' sums into
# partial sums that are all-reduced; a reference computes the same sums in its own order) differs by at most
# K * u relative to the magnitude of its terms (u: fp32 unit roundoff; Higham's gamma_K, worst case, where
# rounding errors typically grow as sqrt(K)). Errors of chained reductions add up, the layers' gains being
# about 1 (residual stream, RMSNorm), so an output's bound is u times the sum of the reduction lengths on its
# path. Per decoder layer: two RMSNorms (hidden each), qkv (hidden), attention scores (head_dim), the
# probability-weighted values (sequence), o_proj (hidden), gate/up (hidden), down (intermediate).
U = torch.finfo(torch.float32).eps / 2
HIDDEN, HEAD_DIM, INTERMEDIATE, LAYERS, VOCAB = 32, 8, 64, 4, 200  # helpers.megatron_tiny_models.hf_model
PER_LAYER = 5 * HIDDEN + HEAD_DIM + WIDTH + INTERMEDIATE
TRUNK = LAYERS * PER_LAYER + HIDDEN  # + the final norm
VALUE_BOUND = (TRUNK + HIDDEN) * U  # + the value head's dot product
LOG_PROB_BOUND = (TRUNK + HIDDEN + VOCAB) * U  # + the lm head's dot product and the log-sum-exp over the vocab
# Backward runs the same reductions transposed; a weight's gradient also sums over the batch's tokens.
GRAD_BOUND = (2 * (TRUNK + HIDDEN) + 4 * WIDTH) * U
# Each bound is one result's distance from the exact value; two results computed differently (a layout and
# the reference) are at most twice that apart.


def value_loss(outputs, micro_batch):
    mask = micro_batch["response_mask"].float()
    return ((outputs["values"] - micro_batch["returns"]) ** 2 * mask).sum() / mask.sum(), {}


def _job(hf_dir, value_weight, score_weight, batch):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.roles import Actor, Critic, RewardModel
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    config = model_config(hf_dir)
    checkpoint = HFCheckpoint(hf_dir)

    def weights_with(head_weight):
        return lambda name: head_weight if name == "score.weight" else checkpoint.get(name)

    report = {}
    for name, (tp, pp, sequence_parallel) in LAYOUTS.items():
        initialize_megatron(tp, pp, seed=2)
        row = report[name] = {}

        actor_engine = MegatronEngine(config, sequence_parallel=sequence_parallel)
        load_hf_into_model(actor_engine.module, config, checkpoint.get)
        row.update(Actor(actor_engine, micro_batch_size=2).compute_log_prob(batch, calculate_entropy=True))

        critic_engine = MegatronEngine(config, head="value", optim=OptimConfig(lr=1e-2, weight_decay=0.0),
                                       sequence_parallel=sequence_parallel)
        load_hf_into_model(critic_engine.module, config, weights_with(value_weight), "value")
        critic = Critic(critic_engine, micro_batch_size=2)
        row["values"] = critic.compute_values(batch)["values"]
        metrics = critic.update_critic(batch, value_loss)
        row["loss"], row["grad_norm"] = metrics["loss"], metrics["grad_norm"]
        row["num_params"] = sum(p.numel() for p in critic_engine.module.parameters())
        if critic_engine.is_last_stage:
            head = critic_engine.module.output_layer.weight
            # Every rank saw the whole batch, so the DP average of the gradient is the gradient.
            row["value_head_grad"] = head.main_grad.detach().clone()
            replicas = [torch.empty_like(head) for _ in range(tp)]
            dist.all_gather(replicas, head.detach().contiguous(), group=mpu.get_tensor_model_parallel_group())
            row["value_head_replicas_equal"] = all(torch.equal(r, replicas[0]) for r in replicas)

        rm_engine = MegatronEngine(config, head="score", sequence_parallel=sequence_parallel)
        load_hf_into_model(rm_engine.module, config, weights_with(score_weight), "score")
        row.update(RewardModel(rm_engine, micro_batch_size=2).compute_rm_score(batch))
        destroy_megatron()
    return report


def _odd_width_batch():
    full = padded_batch(seed=6)
    ids, mask = full["input_ids"][:, :WIDTH], full["attention_mask"][:, :WIDTH]
    # Valid runs of 11, 8, 10 and 9 tokens: micro-batch rows 0-1 need all 11 columns (12 under sequence
    # parallelism, past the width), rows 2-3 need 10.
    assert mask.sum(dim=1).tolist() == [11, 8, 10, 9]
    generator = torch.Generator().manual_seed(7)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0),
            "responses": ids[:, -RESPONSE:], "response_mask": mask[:, -RESPONSE:],
            "returns": torch.randn(ids.size(0), RESPONSE, generator=generator)}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    model = hf_model(MODEL, seed=8)
    hf_dir = save_hf(model, str(tmp_path_factory.mktemp("sp")), sharded=False)
    generator = torch.Generator().manual_seed(9)
    value_weight, score_weight = (torch.randn(1, HIDDEN, generator=generator) / HIDDEN ** 0.5 for _ in range(2))
    batch = _odd_width_batch()
    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"]).last_hidden_state
    # verl's slicing: the value of response token t is read at the position before it.
    hf_values = (hidden[:, -RESPONSE - 1:-1] @ value_weight.T).squeeze(-1) * batch["response_mask"]
    reports = run_ranks(_job, 4, hf_dir, value_weight, score_weight, batch, timeout_s=240)
    # Rank 3 is a last pipeline stage at every layout and holds every result.
    return reports, hf_values, batch


def _assert_close(found, expected, bound, what, scale=None):
    """|found - expected| <= bound * scale; the scale of an output of order-1 terms is at least 1."""
    scale = max(1.0, float(expected.abs().max())) if scale is None else scale
    worst = float((found - expected).abs().max())
    assert worst <= bound * scale, f"{what}: max difference {worst:.3e} > {bound * scale:.3e}"


def test_tp1_values_are_the_hf_trunk_under_the_value_head(outputs):
    reports, hf_values, _ = outputs
    for rank, report in enumerate(reports):
        _assert_close(report["tp1"]["values"], hf_values, 2 * VALUE_BOUND, f"rank {rank} tp1 values vs HF")


@pytest.mark.parametrize("layout", ["tp2_sp", "tp2_sp_pp2"])
def test_sequence_parallel_outputs_match_tp1(outputs, layout):
    reports, _, batch = outputs
    mask = batch["response_mask"].bool()
    for rank, report in enumerate(reports):  # every rank holds the results (broadcast from the last stage)
        found, expected = report[layout], report["tp1"]
        for key, bound in (("log_probs", LOG_PROB_BOUND), ("entropy", LOG_PROB_BOUND), ("values", VALUE_BOUND)):
            assert found[key].shape == (len(mask), RESPONSE), (key, found[key].shape)
            _assert_close(found[key], expected[key], 2 * bound, f"rank {rank} {layout} {key}")
            # Response padding reads 0 at every layout.
            assert torch.equal(found[key][~mask], torch.zeros_like(found[key][~mask])), key
        _assert_close(found["rm_scores"], expected["rm_scores"], 2 * VALUE_BOUND, f"rank {rank} {layout} rm_scores")
        assert found["loss"] == pytest.approx(expected["loss"], rel=2 * VALUE_BOUND, abs=2 * VALUE_BOUND)


@pytest.mark.parametrize("layout", ["tp2_sp", "tp2_sp_pp2"])
def test_sequence_parallel_critic_gradient_matches_tp1(outputs, layout):
    reports, _, _ = outputs
    reference = reports[-1]["tp1"]
    # The gradient norm adds the squares of every parameter's gradient (TP1 holds them all): one more sum.
    norm_bound = GRAD_BOUND + reference["num_params"] * U
    for rank, report in enumerate(reports):
        found = report[layout]
        assert found["grad_norm"] == pytest.approx(reference["grad_norm"], rel=2 * norm_bound)
        if "value_head_grad" not in found:  # not a last pipeline stage
            continue
        # Each TP rank's share of the gradient covers its part of the sequence; summed over TP, the replicas
        # take the same step.
        assert found["value_head_replicas_equal"], f"rank {rank} {layout}: value head replicas differ"
        expected = reference["value_head_grad"]
        _assert_close(found["value_head_grad"], expected, 2 * GRAD_BOUND, f"rank {rank} {layout} value head gradient",
                      scale=float(expected.abs().max()))
