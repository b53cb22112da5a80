"""Reshard planner specification: layouts, groups and plans of every rank, in one process.

Correctness is checked against the pure-torch reference (helpers.reshard_oracle): every rank's
training shard is built from element ids (1-based, so padding reads 0), the plans of all ranks are
executed here with the compiled copy op and simulated collectives, and each rollout buffer must
equal the reference SGLang shard of the same ids.
"""

import pytest
import torch
from helpers.reshard_oracle import fsdp_shard, megatron_shard, sglang_shard

from verl.bench.reshard import main as bench_main
from verl.hybrid_engine.executor import ReshardBindError, ReshardExecutor, flat_offsets
from verl.hybrid_engine.groups import GENERAL, HYBRIDFLOW, derive_groups
from verl.hybrid_engine.layouts import (
    FSDPLayout,
    LayoutError,
    TrainingLayout,
    hf_tensor_shapes,
    local_shape,
    training_param_specs,
)
from verl.hybrid_engine.planner import ALL_GATHER, plan_reshard
from verl.hybrid_engine.rollout_layout import RolloutLayout, rollout_param_specs
from verl.models.config import ModelConfig
from verl.ops.copy_program import make_program, run_copy_program


def tiny(vocab=1024, heads=8, kv=4, layers=4, tied=False, model_type="qwen2"):
    return ModelConfig.from_dict(dict(
        model_type=model_type, vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=4, tie_word_embeddings=tied))


def id_weights(config):
    """Every logical element gets a distinct id >= 1."""
    out, start = {}, 1
    for name, shape in hf_tensor_shapes(config).items():
        n = torch.Size(shape).numel()
        out[name] = torch.arange(start, start + n, dtype=torch.int64).reshape(shape)
        start += n
    return out


def flat(tensors, specs):
    offsets, numel = flat_offsets(specs)
    buf = torch.zeros(numel, dtype=torch.int64)
    for name, shape in specs:
        buf[offsets[name]:offsets[name] + torch.Size(shape).numel()] = tensors[name].reshape(-1)
    return buf, offsets


def program(segments, src_offsets, dst_offsets, src_base=0, dst_base=0):
    return make_program((s.src_offset + (src_offsets[s.src_param] if s.src_param else src_base),
                         s.dst_offset + (dst_offsets[s.dst_param] if s.dst_param else dst_base),
                         s.rows, s.row_elems, s.src_stride, s.dst_stride) for s in segments)


def training_shard(hf, config, training, rank):
    """(tensors, specs) of ``rank``'s training shard from the reference functions."""
    s, _, t = training.coords(rank)
    if isinstance(training, FSDPLayout):
        shard = fsdp_shard(hf, training.shard, t)
        return shard, [(name, tuple(x.shape)) for name, x in shard.items()]
    _, e, et = training.expert_coords(rank)
    return (megatron_shard(hf, config, training.tp, training.pp, t, s, training.ep, e, training.etp, et),
            training_param_specs(config, training.tp, training.pp, t, s, training.ep, e, training.etp, et))


def simulate(config, training, tg, bucket_bytes):
    """Run every rank's plan in this process; returns (plans, rollout buffers, expected buffers, train buffers)."""
    hf = id_weights(config)
    n = training.world_size
    plans = [plan_reshard(config, training, RolloutLayout(tg), r, bucket_bytes) for r in range(n)]
    train, roll, expected, writes = [], [], [], []
    for r in range(n):
        train.append(flat(*training_shard(hf, config, training, r)))
        rspecs = [(x.name, x.shape) for x in rollout_param_specs(config, tg, plans[r].rollout_tp_rank)]
        expected.append(flat(sglang_shard(hf, config, tg, plans[r].rollout_tp_rank), rspecs)[0])
        offsets, numel = flat_offsets(rspecs)
        roll.append((torch.full((numel,), -1, dtype=torch.int64), offsets))
        writes.append(sum(s.numel for s in plans[r].local) + sum(z[2] for z in plans[r].zero_fill))
    for r, p in enumerate(plans):
        buf, offsets = roll[r]
        for name, offset, numel in p.zero_fill:
            buf[offsets[name] + offset:offsets[name] + offset + numel] = 0
        run_copy_program(train[r][0], buf, program(p.local, train[r][1], offsets))
    # Collectives in the order every rank issues them: its all-gathers, then the world all-to-alls.
    gathers = {}
    for r, p in enumerate(plans):
        for b in p.buckets:
            if b.collective == ALL_GATHER:
                gathers.setdefault((b.group, b.index), {})[r] = b
    for (group, _), members in sorted(gathers.items()):
        recv = torch.zeros(members[group[0]].recv_elems, dtype=torch.int64)
        for r, b in members.items():  # packing into its own slot is the in-place all-gather
            run_copy_program(train[r][0], recv, program(b.pack, train[r][1], {}))
        for r, b in members.items():
            run_copy_program(recv, roll[r][0], program(b.unpack, {}, roll[r][1]))
            writes[r] += sum(s.numel for s in b.unpack)
    a2a = [[b for b in p.buckets if b.collective != ALL_GATHER] for p in plans]
    assert len({len(x) for x in a2a}) == 1, "every rank must issue the same number of all-to-alls"
    for k in range(len(a2a[0])):
        sends = []
        for r in range(n):
            send = torch.zeros(a2a[r][k].send_elems, dtype=torch.int64)
            run_copy_program(train[r][0], send, program(a2a[r][k].pack, train[r][1], {}))
            sends.append(send.split(list(a2a[r][k].send_splits)))
        for r in range(n):
            recv = torch.cat([sends[src][r] for src in range(n)])
            assert recv.numel() == a2a[r][k].recv_elems
            run_copy_program(recv, roll[r][0], program(a2a[r][k].unpack, {}, roll[r][1]))
            writes[r] += sum(s.numel for s in a2a[r][k].unpack)
    return plans, [b for b, _ in roll], expected, [b for b, _ in train], writes


MATRIX = [  # (p, t, d, t_g): HybridFlow cases up to 64 ranks, and the general ones
    (1, 2, 1, 1), (1, 2, 1, 2), (2, 2, 1, 2), (2, 2, 1, 1), (1, 2, 2, 1), (1, 4, 2, 2), (2, 4, 2, 2),
    (4, 4, 4, 2), (2, 4, 8, 4), (4, 2, 8, 1),
    (2, 1, 1, 2), (1, 2, 2, 4), (2, 2, 1, 4), (4, 1, 2, 8), (1, 1, 4, 4),
]


@pytest.mark.parametrize("p,t,d,tg", MATRIX, ids=[f"p{p}t{t}d{d}-tg{g}" for p, t, d, g in MATRIX])
def test_every_rollout_element_written_once_with_the_reference_value(p, t, d, tg):
    config = tiny(kv=4 if tg <= 4 else 8, tied=(p + t + tg) % 2 == 0)
    training = TrainingLayout(tp=t, pp=p, dp=d)
    plans, rollout, expected, train, writes = simulate(config, training, tg, bucket_bytes=4096)
    for r in range(training.world_size):
        assert torch.equal(rollout[r], expected[r]), f"rank {r} rollout differs from the reference"
        assert writes[r] == rollout[r].numel(), f"rank {r}: {writes[r]} writes for {rollout[r].numel()} elements"
    assert plans[0].case == (HYBRIDFLOW if t % tg == 0 else GENERAL)


@pytest.mark.parametrize("p,t,d,tg", [m for m in MATRIX if m[1] % m[3] == 0])
def test_hybridflow_training_shard_inside_rollout_shard_and_bytes_match_formula(p, t, d, tg):
    config = tiny(tied=p % 2 == 0)  # vocab 1024: Megatron and SGLang vocab shards align
    training = TrainingLayout(tp=t, pp=p, dp=d)
    plans, rollout, _, train, _ = simulate(config, training, tg, bucket_bytes=1 << 20)
    for r, plan in enumerate(plans):
        held = set(train[r][train[r] > 0].tolist())
        assert held <= set(rollout[r].tolist()), f"rank {r}: training shard not inside its rollout shard"
        assert all(b.collective == ALL_GATHER for b in plan.buckets)
        assert len(plan.micro_dp_group) == p * t // tg
        own = sum(seg.numel for b in plan.buckets for seg in b.pack) + sum(seg.numel for seg in plan.local)
        payload = plan.model_bytes // tg // plan.element_size
        assert plan.bytes_received == (payload - own) * plan.element_size
    mean = sum(pl.bytes_received for pl in plans) / len(plans)
    assert mean == pytest.approx(plans[0].bytes_formula, rel=1e-12)
    assert plans[0].bytes_formula == (p * t - tg) / (tg * p * t) * plans[0].model_bytes


def tiny_moe(layers=4, experts=8, tied=False):
    """Qwen3-MoE: layer 1 dense (mlp_only_layers), the rest route to 2 of ``experts`` experts."""
    return ModelConfig.from_dict(dict(
        model_type="qwen3_moe", vocab_size=1024, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=4, tie_word_embeddings=tied, num_experts=experts,
        num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[1]))


MOE_MATRIX = [  # (p, t, d, ep, etp, t_g): etp None = t
    (1, 1, 2, 2, None, 1), (1, 2, 2, 2, None, 2), (1, 2, 2, 2, None, 1), (2, 2, 2, 2, None, 2),
    (2, 2, 4, 4, None, 1), (1, 2, 8, 8, None, 2), (1, 2, 2, 4, 1, 1), (1, 2, 2, 4, 1, 2), (1, 4, 2, 2, 2, 2),
    (1, 2, 1, 1, 1, 2), (1, 2, 2, 2, None, 4), (2, 1, 2, 2, None, 2),
]


@pytest.mark.parametrize("p,t,d,ep,etp,tg", MOE_MATRIX,
                         ids=[f"p{p}t{t}d{d}ep{ep}etp{etp}-tg{g}" for p, t, d, ep, etp, g in MOE_MATRIX])
def test_experts_reshard_to_the_reference_and_expert_bytes_match_the_formula(p, t, d, ep, etp, tg):
    """Every rollout element (each rank holds every expert, TP inside each) written once with the reference
    value from a training layout whose experts sit on EP ranks (and etp ranks); with etp = t and t_g | t the
    mean bytes received equal the formula with the dense and expert parts apart (docs/moe.md)."""
    config = tiny_moe(tied=p == 2)
    training = TrainingLayout(tp=t, pp=p, dp=d, ep=ep, etp=etp)
    plans, rollout, expected, _, writes = simulate(config, training, tg, bucket_bytes=4096)
    for r in range(training.world_size):
        assert torch.equal(rollout[r], expected[r]), f"rank {r} rollout differs from the reference"
        assert writes[r] == rollout[r].numel(), f"rank {r}: {writes[r]} writes for {rollout[r].numel()} elements"
    plan = plans[0]
    assert 0 < plan.expert_bytes < plan.model_bytes
    if t % tg == 0 and (etp is None or etp == t):
        assert plan.case == HYBRIDFLOW
        mean = sum(pl.bytes_received for pl in plans) / len(plans)
        m, x = plan.model_bytes, plan.expert_bytes
        assert mean == pytest.approx((p * t - tg) / (tg * p * t) * (m - x) + (p * t * ep - tg) / (tg * p * t * ep) * x,
                                     rel=1e-12)
        assert plan.bytes_formula == pytest.approx(mean, rel=1e-12)


def test_an_expert_every_micro_dp_member_holds_is_copied_not_received():
    """etp=1 with ep=1: every tp rank holds every expert whole; at t_g = 1 no expert byte moves."""
    config = tiny_moe()
    plans, rollout, expected, _, _ = simulate(config, TrainingLayout(tp=2, pp=1, dp=1, ep=1, etp=1), 1, 4096)
    assert all(torch.equal(a, b) for a, b in zip(rollout, expected, strict=True))
    dense = plans[0].model_bytes - plans[0].expert_bytes
    assert all(pl.bytes_received <= dense for pl in plans)


def test_bad_expert_layouts_are_refused():
    with pytest.raises(LayoutError, match="expected a divisor of the 4 ranks of a pipeline stage"):
        TrainingLayout(tp=2, pp=1, dp=2, ep=8)
    with pytest.raises(LayoutError, match="expected ep | num_experts=8"):
        TrainingLayout(tp=1, pp=1, dp=3, ep=3).params(tiny_moe(), 0)
    with pytest.raises(LayoutError, match="expected ep=1 and etp=tp for a dense model"):
        TrainingLayout(tp=1, pp=1, dp=2, ep=2).params(tiny(), 0)
    with pytest.raises(LayoutError, match="use the megatron strategy"):
        FSDPLayout(2).params(tiny_moe())


def test_vocab_rows_across_padding_boundaries_move_by_all_to_all():
    config = tiny(vocab=300)  # Megatron pads to 512 (t=2): rows 160..255 sit on tp rank 0, rollout rank 1
    plans, rollout, expected, _, _ = simulate(config, TrainingLayout(tp=2, pp=2), 2, bucket_bytes=4096)
    assert all(torch.equal(a, b) for a, b in zip(rollout, expected, strict=False))
    assert any(b.collective != ALL_GATHER and b.payload_received for b in plans[1].buckets)


def test_buckets_respect_bucket_bytes_and_plans_are_deterministic():
    config = tiny()
    for train, tg in (((2, 2, 1), 1), ((1, 2, 1), 2)):
        training = TrainingLayout(*train)
        for rank in range(training.world_size):
            plan = plan_reshard(config, training, RolloutLayout(tg), rank, bucket_bytes=3000)
            assert len(plan.buckets) > 1
            assert plan.peak_extra_bytes <= 3000
            assert plan == plan_reshard(config, training, RolloutLayout(tg), rank, bucket_bytes=3000)


def test_summary_names_case_reason_bytes_and_peak():
    plan = plan_reshard(tiny(), TrainingLayout(tp=1, pp=2), RolloutLayout(2), 0)
    text = plan.summary()
    for needle in ("case: general", "is larger than t=1", "bytes sent", "peak extra bytes"):
        assert needle in text


def test_groups_match_the_hybridflow_figure():
    groups = derive_groups(TrainingLayout(tp=4, pp=1, dp=2), 2)
    assert groups.case == HYBRIDFLOW
    assert groups.rollout_tp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert groups.micro_dp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_rank_numbering_matches_megatron_parallel_state_default_order():
    from megatron.core.parallel_state import RankGenerator

    for tp, dp, pp in ((2, 2, 2), (4, 2, 1), (1, 2, 4)):
        gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        layout = TrainingLayout(tp=tp, pp=pp, dp=dp)
        for group in gen.get_ranks("tp"):
            assert [layout.coords(r)[2] for r in group] == list(range(tp))
            assert len({layout.coords(r)[:2] for r in group}) == 1
        for group in gen.get_ranks("pp"):
            assert [layout.coords(r)[0] for r in group] == list(range(pp))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_training_param_specs_match_reference_megatron_state_dict(tp, pp, tied):
    config = tiny(vocab=300, tied=tied, model_type="llama")
    hf = id_weights(config)
    for s in range(pp):
        for r in range(tp):
            ref = [(n, tuple(t.shape)) for n, t in megatron_shard(hf, config, tp, pp, r, s).items()]
            assert [(x.name, x.shape) for x in training_param_specs(config, tp, pp, r, s)] == ref


def test_layout_errors_say_expected_and_found():
    with pytest.raises(LayoutError, match="training tp=3: expected a divisor .* does not divide"):
        training_param_specs(tiny(), 3, 1, 0, 0)
    with pytest.raises(LayoutError, match="expected a divisor of num_hidden_layers=4, found|training pp=3"):
        training_param_specs(tiny(), 1, 3, 0, 0)
    with pytest.raises(LayoutError, match="expected a positive divisor of the world size 4, found 3"):
        derive_groups(TrainingLayout(tp=2, pp=2), 3)


def test_bench_cli_rejects_bad_layout_with_exit_code_2(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "qwen2", "vocab_size": 300, "hidden_size": 16, "intermediate_size": 32, '
                   '"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4}')
    assert bench_main(["--model", str(cfg), "--train", "tp=2,pp=2", "--rollout", "tp=2", "--nproc", "3"]) == 2
    assert "--nproc: expected tp*pp*dp = 4, found 3" in capsys.readouterr().err
    assert bench_main(["--model", str(cfg), "--train", "tq=2", "--rollout", "tp=2", "--nproc", "2"]) == 2


# ------------------------------------------------------------------------------------------------
# FSDP2 training layout
# ------------------------------------------------------------------------------------------------

def uneven(tied=False):
    """Sizes FSDP cannot split evenly: vocab 37, hidden 24, intermediate 44, k/v 12 rows (head_dim 6)."""
    return ModelConfig.from_dict(dict(
        model_type="qwen2", vocab_size=37, hidden_size=24, intermediate_size=44, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def test_fsdp_layout_numbers_ranks_as_a_replicate_by_shard_mesh_and_shards_like_torch_chunk():
    layout = FSDPLayout(shard=4, replicate=2)
    assert (layout.tp, layout.pp, layout.dp, layout.world_size) == (4, 1, 2, 8)
    assert [layout.coords(r) for r in (0, 3, 4, 7)] == [(0, 0, 0), (0, 0, 3), (0, 1, 0), (0, 1, 3)]
    assert all(layout.rank(*layout.coords(r)) == r for r in range(8))
    for tied in (True, False):
        config = uneven(tied)
        shapes = hf_tensor_shapes(config)
        params = layout.params(config)
        assert [p.name for p in params] == list(shapes)  # what Qwen2ForCausalLM.named_parameters() names
        assert ("lm_head.weight" in shapes) is not tied
        hf = id_weights(config)
        for r in range(4):
            ref = fsdp_shard(hf, 4, r)
            assert [local_shape(p, shapes, 4, r) for p in params] == [tuple(ref[p.name].shape) for p in params]
    norm = ModelConfig.from_dict(dict(model_type="llama", vocab_size=8, hidden_size=5, intermediate_size=4,
                                      num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1))
    p = next(x for x in FSDPLayout(4).params(norm) if x.name == "model.norm.weight")
    assert [local_shape(p, hf_tensor_shapes(norm), 4, r) for r in range(4)] == [(2,), (2,), (1,), (0,)]
    with pytest.raises(LayoutError, match="fsdp shard: expected a positive integer, found 0"):
        FSDPLayout(0)
    with pytest.raises(LayoutError, match="fsdp replicate: expected a positive integer, found 1.5"):
        FSDPLayout(2, 1.5)


FSDP_MATRIX = [  # (shard, replicate, t_g)
    (2, 1, 1), (4, 1, 1), (8, 1, 1), (2, 2, 1), (3, 1, 1),
    (2, 1, 2), (4, 1, 2), (8, 1, 2), (2, 2, 2), (4, 1, 4), (2, 2, 4), (1, 2, 2), (1, 4, 4), (8, 1, 4),
]


@pytest.mark.parametrize("shard,replicate,tg", FSDP_MATRIX, ids=[f"fsdp{s}r{r}-tg{g}" for s, r, g in FSDP_MATRIX])
def test_fsdp_every_rollout_element_once_and_only_what_a_rank_lacks_is_received(shard, replicate, tg):
    config = uneven(tied=(shard + tg) % 2 == 1)
    training = FSDPLayout(shard, replicate)
    plans, rollout, expected, train, writes = simulate(config, training, tg, bucket_bytes=2048)
    if shard == 8:  # k/v have 12 rows: chunks of 2 leave the last two shard ranks empty
        assert fsdp_shard(id_weights(config), 8, 7)["model.layers.0.self_attn.k_proj.weight"].shape == (0, 24)
    for r, plan in enumerate(plans):
        assert torch.equal(rollout[r], expected[r]), f"rank {r} rollout differs from the reference"
        assert writes[r] == rollout[r].numel(), f"rank {r}: {writes[r]} writes for {rollout[r].numel()} elements"
        # Independent of the planner: the ids this rank's FSDP shard holds that its rollout shard needs.
        need = expected[r][expected[r] > 0]
        held = int(torch.isin(need, train[r]).sum())
        esize = plan.element_size
        assert plan.bytes_received == (need.numel() - held) * esize == plan.bytes_formula, f"rank {r}"
        own = sum(seg.numel for seg in plan.local) + sum(seg.numel for b in plan.buckets
                                                          if b.collective == ALL_GATHER for seg in b.pack)
        assert own == held, f"rank {r}: {own} elements copied from its own shard, it holds {held}"
        if tg == 1:
            assert plan.case == HYBRIDFLOW and "FSDP shard" in plan.reason
            assert all(b.collective == ALL_GATHER for b in plan.buckets)
            _, rep, _ = training.coords(r)
            assert plan.micro_dp_group == tuple(range(rep * shard, (rep + 1) * shard))
        else:
            assert plan.case == GENERAL and "row blocks" in plan.reason
            assert not any(b.collective == ALL_GATHER for b in plan.buckets)
            assert sum(seg.numel for seg in plan.local) == held


@pytest.mark.parametrize("shard", [2, 4])
def test_fsdp_to_tp1_receives_the_textbook_share_when_sizes_divide(shard):
    config = tiny(vocab=1024, tied=shard == 2)  # every dim divisible by 4
    plans, _, _, _, _ = simulate(config, FSDPLayout(shard), 1, bucket_bytes=1 << 20)
    for plan in plans:
        assert plan.bytes_received == plan.bytes_formula == (shard - 1) / shard * plan.model_bytes
        assert plan.padding_bytes == 0


def test_fsdp_summary_names_the_layout_and_groups_say_why():
    groups = derive_groups(FSDPLayout(2, replicate=2), 1)
    assert groups.micro_dp_groups == ((0, 1), (2, 3)) and groups.case == HYBRIDFLOW
    assert "training FSDP(shard=2, replicate=2)" in groups.summary()
    # t_g | t is Megatron's all-gather case, not FSDP's: its row blocks are not parts of rollout shards.
    assert derive_groups(TrainingLayout(tp=4, pp=1), 2).case == HYBRIDFLOW
    assert derive_groups(FSDPLayout(4), 2).case == GENERAL
    assert derive_groups(FSDPLayout(4), 2).rollout_tp_groups == ((0, 2), (1, 3))
    plan = plan_reshard(uneven(), FSDPLayout(4), RolloutLayout(2), 3, dtype="float32")
    assert "training FSDP(shard=4, replicate=1) -> rollout t_g=2" in plan.summary()


def test_executor_on_separate_tensors_names_what_is_missing_or_wrong():
    config = uneven()
    plan = plan_reshard(config, FSDPLayout(2), RolloutLayout(2), 0, bucket_bytes=2048, dtype="float32")
    shard = fsdp_shard(id_weights(config), 2, 0)
    sources = {n: t.to(torch.float32).reshape(-1) for n, t in shard.items()}
    specs = [(s.name, s.shape) for s in rollout_param_specs(config, 2, 0)]
    gone = dict(sources)
    del gone["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ReshardBindError, match="'model.layers.1.mlp.down_proj.weight', not found among"):
        ReshardExecutor(plan, gone, None, specs, None)
    with pytest.raises(ReshardBindError, match="expected float32 elements .4 bytes., found torch.float64"):
        ReshardExecutor(plan, {n: t.double() for n, t in sources.items()}, None, specs, None)
    executor = ReshardExecutor(plan, sources, None, specs, None)
    with pytest.raises(ReshardBindError, match="sources: expected this transition's training tensors"):
        executor.to_rollout()
    short = dict(sources, **{"model.norm.weight": sources["model.norm.weight"][:5]})
    with pytest.raises(ReshardBindError, match=r"sources\['model.norm.weight'\]: expected a contiguous 1-D "
                                               r"torch.float32 tensor of 12 elements on cpu, found torch.float32"):
        executor.to_rollout(sources=short)


def test_bench_cli_rejects_bad_fsdp_layout_with_exit_code_2(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "qwen2", "vocab_size": 37, "hidden_size": 24, "intermediate_size": 44, '
                   '"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}')
    assert bench_main(["--model", str(cfg), "--train", "fsdp=2,replicate=2", "--rollout", "tp=2", "--nproc", "2"]) == 2
    assert "--nproc: expected fsdp*replicate = 4, found 2" in capsys.readouterr().err
    assert bench_main(["--model", str(cfg), "--train", "fsdp=2,tp=2", "--rollout", "tp=2", "--nproc", "2"]) == 2
    assert "expected comma-separated fsdp/replicate=<positive int>, found 'tp=2'" in capsys.readouterr().err
