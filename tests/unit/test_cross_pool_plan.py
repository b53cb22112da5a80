"""Cross-pool plan specification: every rank's plan run in one process against the pure-torch oracle.

Training shards are built from element ids (helpers.reshard_oracle: Megatron and FSDP), each bucket's
spans are matched sender to receiver as the bridge's point-to-point messages would be, and every rollout
rank's buffer must equal the reference SGLang shard of the same ids. On top: each rollout rank receives
exactly its shard's payload once (the formula), training ranks send evenly, buckets respect the cap, and
the delta codec and checksum behave as the receiver relies on.
"""

import math

import pytest
import torch
from helpers.reshard_oracle import sglang_shard
from test_reshard_planner import flat, id_weights, program, tiny, training_shard

from verl.errors import InputError
from verl.hybrid_engine.cross_pool import ROLLOUT, TRAINING, PoolPlacement, plan_cross_pool
from verl.hybrid_engine.executor import flat_offsets
from verl.hybrid_engine.layouts import FSDPLayout, LayoutError, TrainingLayout
from verl.hybrid_engine.rollout_layout import rollout_param_specs
from verl.hybrid_engine.weight_sync import apply_delta, checksum, encode_delta
from verl.ops.copy_program import run_copy_program


def simulate(config, placement, bucket_bytes):
    """Every bridge rank's plan, executed here: returns (plans, rollout buffers, expected buffers)."""
    hf = id_weights(config)
    plans = [plan_cross_pool(config, placement, r, bucket_bytes, "float32") for r in range(placement.world_size)]
    train = {r: flat(*training_shard(hf, config, placement.training, r)) for r in range(placement.n_training)}
    roll, expected = {}, {}
    for r in range(placement.n_training, placement.world_size):
        j = plans[r].rollout_tp_rank
        specs = [(x.name, x.shape) for x in rollout_param_specs(config, placement.rollout_tp, j)]
        offsets, numel = flat_offsets(specs)
        buf = torch.full((numel,), -1, dtype=torch.int64)
        for name, offset, count in plans[r].zero_fill:
            buf[offsets[name] + offset:offsets[name] + offset + count] = 0
        roll[r] = (buf, offsets)
        expected[r] = flat(sglang_shard(hf, config, placement.rollout_tp, j), specs)[0]
    num = {p.num_buckets for p in plans}
    assert len(num) == 1, "every rank must agree on the bucket count"
    for index in range(num.pop()):
        sent = {}
        for r, p in enumerate(plans[:placement.n_training]):
            for b in (b for b in p.buckets if b.index == index):
                buf = torch.zeros(b.numel, dtype=torch.int64)
                run_copy_program(train[r][0], buf, program(b.program, train[r][1], {}))
                for span in b.spans:
                    sent[(r, span.peer)] = buf[span.offset:span.offset + span.numel]
        for r in range(placement.n_training, placement.world_size):  # replica order: forwards arrive in time
            for b in (b for b in plans[r].buckets if b.index == index):
                recv = torch.cat([sent.pop((span.peer, r)) for span in b.spans])
                assert recv.numel() == b.numel
                run_copy_program(recv, roll[r][0], program(b.program, {}, roll[r][1]))
                if b.forward_to is not None:
                    sent[(r, b.forward_to)] = recv
        assert not sent, f"bucket {index}: messages nobody received: {sorted(sent)}"
    return plans, {r: b for r, (b, _) in roll.items()}, expected


MATRIX = [  # (training layout, rollout tp, replicas)
    (TrainingLayout(tp=2, pp=1, dp=1), 1, 1), (TrainingLayout(tp=2, pp=1, dp=1), 1, 2),
    (TrainingLayout(tp=2, pp=1, dp=1), 2, 1), (TrainingLayout(tp=2, pp=1, dp=1), 2, 2),
    (TrainingLayout(tp=1, pp=2, dp=1), 2, 2), (TrainingLayout(tp=2, pp=2, dp=2), 4, 1),
    (TrainingLayout(tp=1, pp=1, dp=4), 2, 3), (TrainingLayout(tp=4, pp=1, dp=1), 8, 1),
    (FSDPLayout(2), 1, 2), (FSDPLayout(2), 2, 1), (FSDPLayout(2, 2), 2, 2), (FSDPLayout(3), 4, 1),
]
IDS = [f"{t}-tg{g}-R{r}" for t, g, r in MATRIX]


@pytest.mark.parametrize("training,tg,replicas", MATRIX, ids=IDS)
def test_every_rollout_rank_gets_exactly_its_shard_once(training, tg, replicas):
    config = tiny(kv=4 if tg <= 4 else 8, tied=(training.tp + tg) % 2 == 0)
    placement = PoolPlacement(training, tg, replicas)
    plans, rollout, expected = simulate(config, placement, bucket_bytes=2048)
    for r in rollout:
        assert torch.equal(rollout[r], expected[r]), f"bridge rank {r}: rollout differs from the reference"
    formula = plans[0].formula()
    received = [plans[r].bytes for r in range(placement.n_training, placement.world_size)]
    assert received == formula["received_per_rank"]  # its shard's payload, nothing twice, nothing extra
    assert received == [e * 4 for e in plans[0].received_elems]
    sent = [plans[r].bytes for r in range(placement.n_training)]
    forwarded = [plans[r].forwarded_bytes for r in range(placement.n_training, placement.world_size)]
    assert forwarded == formula["forwarded_per_rank"]
    assert placement.forward == (replicas > 1 and tg * replicas > training.world_size)
    first = received[:tg]  # what replica 0 receives: from the training ranks either way
    assert sum(sent) == (sum(first) if placement.forward else sum(received))
    # Rows split evenly over every holder: no training rank sends much more than its share.
    assert max(sent) <= 1.25 * formula["sent_per_rank_mean"], (sent, formula["sent_per_rank_mean"])
    for p in plans:
        assert all(b.numel * 4 <= 2048 for b in p.buckets), "a bucket over bucket_bytes"
        assert p.peak_extra_bytes <= 2 * 2048


def test_roles_ranks_and_feed_rule():
    placement = PoolPlacement(TrainingLayout(tp=2, pp=1, dp=1), 2, 3)
    assert placement.world_size == 8 and placement.n_rollout == 6
    assert placement.role(1) == (TRAINING, 1, 0)
    assert placement.role(2 + 2 * 2 + 1) == (ROLLOUT, 2, 1)
    assert placement.rollout_rank(2, 1) == 7
    assert placement.forward and "R*t_g=6 > N_t=2: replica 0 is fed by the training ranks" in placement.feed_rule
    direct = PoolPlacement(TrainingLayout(tp=2, pp=1, dp=2), 2, 2)
    assert not direct.forward and "every replica is fed by the training ranks" in direct.feed_rule
    with pytest.raises(LayoutError, match="replicas: expected a positive integer, found 0"):
        PoolPlacement(TrainingLayout(tp=2, pp=1, dp=1), 2, 0)
    with pytest.raises(LayoutError, match="bridge rank"):
        placement.role(8)


def test_a_rollout_tp_the_model_cannot_split_is_one_error():
    placement = PoolPlacement(TrainingLayout(tp=2, pp=1, dp=1), 3, 1)
    with pytest.raises(InputError, match="rollout tp=3: expected a divisor of the model's sizes"):
        plan_cross_pool(tiny(), placement, 0, 2048, "float32")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_delta_round_trip_is_bit_exact_and_small_when_few_elements_change(dtype):
    gen = torch.Generator().manual_seed(0)
    old = (torch.randn(10_000, generator=gen) * 0.02).to(dtype)
    new = old.clone()
    idx = torch.randperm(10_000, generator=gen)[:150]
    new[idx] = (new[idx].float() + 1e-3).to(dtype)
    new[5000:5040] = 7  # one long run
    new[3] = -0.0 if float(old[3]) != 0 else 1.0
    runs, values = encode_delta(new, old)
    assert runs.dtype == torch.int32 and runs.shape[0] == 2
    assert int(runs[1].sum()) == values.numel() == int((new.view(torch.int16 if dtype == torch.bfloat16 else
                                                                 torch.int32) != old.view(
        torch.int16 if dtype == torch.bfloat16 else torch.int32)).sum())
    rebuilt = old.clone()
    apply_delta(rebuilt, runs, values)
    assert torch.equal(rebuilt.view(torch.uint8), new.view(torch.uint8))
    assert runs.numel() * 4 + values.numel() * new.element_size() < new.numel() * new.element_size()
    empty_runs, empty_values = encode_delta(new, new)
    assert empty_runs.shape == (2, 0) and empty_values.numel() == 0


def test_checksum_sees_order_sign_of_zero_and_single_bits():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3 * (1 << 20) + 5, generator=gen).to(torch.bfloat16)  # several chunks
    base = checksum(x)
    assert checksum(x.clone()) == base
    swapped = x.clone()
    swapped[[10, 2_000_000]] = swapped[[2_000_000, 10]]
    assert checksum(swapped) != base
    flipped = x.clone()
    flipped.view(torch.int16)[123_456] ^= 1
    assert checksum(flipped) != base
    zeros = torch.zeros(8)
    negative = zeros.clone()
    negative[4] = -0.0
    assert checksum(zeros) != checksum(negative)


def test_the_first_step_fails_loudly_past_the_rollout_dtype_bound():
    from verl.trainer.metrics import RolloutMismatchError, check_rollout_probs_diff, rollout_probs_diff_bound

    assert rollout_probs_diff_bound("float32") == pytest.approx(4096 * torch.finfo(torch.float32).eps)
    assert rollout_probs_diff_bound("bfloat16") == 0.9
    check_rollout_probs_diff({"training/rollout_probs_diff_max": 1e-5}, "float32")
    check_rollout_probs_diff({}, "float32")  # bypass mode: no actor log-probs, nothing to compare
    check_rollout_probs_diff({"training/rollout_probs_diff_max": 0.3}, "bfloat16")
    with pytest.raises(RolloutMismatchError, match=r"rollout_probs_diff_max=0\.01 at the first step: expected at "
                                                   r"most 0\.0004883 for a float32 rollout"):
        check_rollout_probs_diff({"training/rollout_probs_diff_max": 0.01}, "float32")
    with pytest.raises(RolloutMismatchError):
        check_rollout_probs_diff({"training/rollout_probs_diff_max": 0.97}, "bfloat16")


def test_the_rollout_gap_is_also_reported_in_log_prob_space():
    """A token the actor gives p = 0.01 and the rollout 0.02 differs by 0.01 in probability -- below the 0.9 a
    bf16 rollout may show there -- but by log 2 in log-prob space, where rounding's gap is the same at every p."""
    from verl.protocol import DataProto
    from verl.trainer.metrics import compute_rollout_probs_diff_metrics

    old = torch.tensor([[0.5, 0.01, 0.9]]).log()
    rollout = torch.tensor([[0.5, 0.02, 0.3]]).log()
    batch = DataProto.from_dict({"old_log_probs": old, "rollout_log_probs": rollout,
                                 "response_mask": torch.tensor([[1, 1, 0]])})
    metrics = compute_rollout_probs_diff_metrics(batch)
    assert metrics["training/rollout_log_probs_diff_max"] == pytest.approx(math.log(2), rel=1e-6)
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.01, rel=1e-5)  # the masked 0.6 is not seen


@pytest.mark.parametrize("training,tg,replicas", [
    (TrainingLayout(tp=1, pp=1, dp=2, ep=2), 1, 2), (TrainingLayout(tp=2, pp=1, dp=2, ep=2), 2, 1),
    (TrainingLayout(tp=1, pp=2, dp=2, ep=2), 2, 2), (TrainingLayout(tp=2, pp=1, dp=2, ep=4, etp=1), 2, 1),
], ids=["ep2-tg1-R2", "tp2ep2-tg2-R1", "pp2ep2-tg2-R2", "tp2ep4etp1-tg2-R1"])
def test_a_standalone_pool_receives_every_expert_from_the_ranks_that_hold_it(training, tg, replicas):
    """Qwen3-MoE across pools: each rollout rank (every expert, TP inside each) gets exactly its shard once, the
    experts from the EP ranks (and ETP slices) that hold them."""
    from test_reshard_planner import tiny_moe

    config = tiny_moe(tied=training.pp == 2)
    placement = PoolPlacement(training, tg, replicas)
    plans, rollout, expected = simulate(config, placement, bucket_bytes=2048)
    for r in rollout:
        assert torch.equal(rollout[r], expected[r]), f"bridge rank {r}: rollout differs from the reference"
    received = [plans[r].bytes for r in range(placement.n_training, placement.world_size)]
    assert received == plans[0].formula()["received_per_rank"]
