"""Activation recompute chosen by memory where the user did not choose (issue 60 item 2): the activation estimate
against what autograd really keeps (transformers' eager Qwen2, fp32), the decision against the memory a rank has,
the user's choice winning, and the local launcher deciding once and handing the choice to its ranks."""

import os

import pytest
import torch
import transformers
from helpers.tiny_models import write_arithmetic_data

from verl.models.activation_memory import activation_bytes
from verl.models.config import ModelConfig
from verl.trainer import main_ppo
from verl.trainer.config import load_config
from verl.trainer.config.recompute_choice import KEY, choose

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "configs", "grpo_arith_tiny.yaml")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
    cfg._attn_implementation = "eager"  # the math path: the scores are kept, as the estimate counts
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).float()
    path = tmp_path_factory.mktemp("qwen2")
    model.config.save_pretrained(path)
    return model, ModelConfig.from_pretrained(str(path))


def saved_bytes(model, ids, checkpointing=False):
    """Bytes of the tensors autograd keeps for the backward of the forward and log-softmax (parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.log_softmax(model(ids).logits.float(), -1)
    finally:
        if checkpointing:
            model.activation_checkpointing_disable()
            model.eval()
    return sum(kept.values())


@pytest.mark.parametrize("batch,seq", [(2, 64), (4, 128), (1, 256)])
def test_the_estimate_is_what_autograd_keeps_within_its_uncounted_parts(qwen2, batch, seq):
    model, config = qwen2
    ids = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(seq))
    measured = saved_bytes(model.eval(), ids)
    estimate = activation_bytes(config, micro_batch=batch, seq_len=seq)
    # The estimate counts the logits' gradient (autograd keeps the log-softmax output instead, smaller at long
    # sequences where the scores dominate) and no dropout: within [0.9, 1.5] of the measured bytes.
    assert 0.9 <= estimate / measured <= 1.5, (estimate, measured)
    with_recompute = activation_bytes(config, micro_batch=batch, seq_len=seq, recompute=True)
    assert saved_bytes(model, ids, checkpointing=True) <= with_recompute < estimate


def test_tensor_and_sequence_parallelism_divide_the_activations(qwen2):
    _, config = qwen2
    one = activation_bytes(config, micro_batch=2, seq_len=128)
    tp2 = activation_bytes(config, micro_batch=2, seq_len=128, tp=2)
    tp2_sp = activation_bytes(config, micro_batch=2, seq_len=128, tp=2, sequence_parallel=True)
    assert one / 2 < tp2 < one and tp2_sp == pytest.approx(one / 2, rel=0.01)
    assert activation_bytes(config, micro_batch=2, seq_len=128, pp=3) < one


@pytest.fixture(scope="module")
def data_args(tmp_path_factory):
    return write_arithmetic_data(tmp_path_factory.mktemp("arith"), 80, 8)


def test_off_when_it_fits_on_when_it_does_not_and_the_users_choice_wins(data_args, monkeypatch):
    config = load_config(GRPO, data_args)
    assert config.actor_rollout_ref.model.enable_gradient_checkpointing is None
    choice, line = choose(config)
    assert choice is False and line.startswith("[recompute] off: the update fits without it (state "), line
    monkeypatch.setenv("VERL_DEVICE_MEMORY_GIB", "0.000001")
    choice, line = choose(config)
    assert choice is True and line.startswith("[recompute] on: the update does not fit without it"), line
    assert "VERL_DEVICE_MEMORY_GIB=0.000001" in line and line.endswith("it may not fit even so"), line
    for value in ("true", "false"):
        assert choose(load_config(GRPO, [*data_args, f"{KEY}={value}"]))[0] is None
    # FSDP: the backend's own memory layout (its model_dtype), the same decision.
    fsdp = load_config(GRPO, [*data_args, "model_engine=dp",
                              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1"])
    assert choose(fsdp)[0] is True
    monkeypatch.setenv("VERL_DEVICE_MEMORY_GIB", "1000")
    assert choose(fsdp)[0] is False and choose(config)[0] is False
    granularity = "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=selective"
    assert choose(load_config(GRPO, [*data_args, granularity]))[0] is False


@pytest.fixture
def spawned(monkeypatch):
    calls = []
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("verl.launcher.spawn.spawn_local", lambda nproc, argv, **kw: calls.append(argv) or 0)
    return calls


def test_the_launcher_decides_once_and_hands_the_choice_to_its_ranks(data_args, spawned, monkeypatch, capsys):
    monkeypatch.setenv("VERL_DEVICE_MEMORY_GIB", "0.000001")
    assert main_ppo.main(["--config", GRPO, *data_args]) == 0
    (argv,) = spawned
    assert argv[-1] == f"{KEY}=true", argv[-3:]
    assert capsys.readouterr().out.count("[recompute] on: ") == 1
    # The user's value reaches the ranks as given, and nothing is decided or printed.
    assert main_ppo.main(["--config", GRPO, *data_args, f"{KEY}=false"]) == 0
    assert not any(a.startswith(f"{KEY}=") for a in spawned[1][:-1]) and spawned[1][-1] == f"{KEY}=false"
    assert "[recompute]" not in capsys.readouterr().out
