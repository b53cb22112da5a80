"""The rollout registry: an engine is one registration (its constructor for the trainer and for `verl generate`, its
declared capabilities), no rollout engine is picked by name outside ``verl/engine/rollout/``, and the engines'
parameter shapes (the model spec's) are the ones the reshard's rollout layout places."""

import dataclasses
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from helpers.moe_models import CONFIGS as MOE_CONFIGS
from helpers.tiny_models import MODELS, save_tiny_model, write_arithmetic_data

from verl.engine.rollout import registry
from verl.engine.rollout.registry import (
    RolloutCapabilityError,
    RolloutEngine,
    RolloutSite,
    register_rollout,
    require_capability,
    rollout_engine,
    unregister_rollout,
)
from verl.hybrid_engine.layouts import hf_tensor_shapes, local_shape
from verl.hybrid_engine.rollout_layout import RolloutLayout
from verl.models.config import ModelConfig
from verl.models.rollout_shapes import ROLLOUT_VOCAB_PADDING, RolloutLayoutError, rollout_param_specs
from verl.trainer import main_ppo
from verl.trainer.config import ConfigError, load_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
GRPO = str(ROOT / "configs" / "grpo_arith_tiny.yaml")
MOE = str(ROOT / "configs" / "grpo_qwen3moe_tiny.yaml")
ARR = "actor_rollout_ref"
SCOUT = "native_scout"


@pytest.fixture(scope="module")
def data_args(tmp_path_factory):
    return write_arithmetic_data(tmp_path_factory.mktemp("arith"), 80, 8)


@pytest.fixture
def scout():
    """A second engine, registered here only: the native engine's constructors under another name, declaring
    neither MoE weights, routing recording nor partial rollout."""
    native = rollout_engine("native")
    caps = dataclasses.replace(native.capabilities, moe_weights=False, routing_recording=False,
                               partial_rollout=False)
    engine = register_rollout(RolloutEngine(SCOUT, caps, build=native.build, open_standalone=native.open_standalone,
                                            lacks={"moe_weights": "a test engine"}))
    yield engine
    unregister_rollout(SCOUT)


def _exit_2_line(capsys, argv):
    assert main_ppo.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("verl train: config error: "), lines
    return lines[0].removeprefix("verl train: config error: ")


# ------------------------------------------------------------------ one registration
def test_a_registered_engine_passes_the_config_check_and_a_missing_capability_is_one_line(scout, data_args, capsys,
                                                                                          monkeypatch):
    monkeypatch.setattr(main_ppo, "run_rank", lambda config, dry_run: pytest.fail("a rank was started"))
    config = load_config(GRPO, [*data_args, f"{ARR}.rollout.name={SCOUT}"])
    assert config.actor_rollout_ref.rollout.name == SCOUT
    line = _exit_2_line(capsys, ["--config", MOE, *data_args, f"{ARR}.rollout.name={SCOUT}"])
    assert line.startswith(f"{ARR}.rollout.name={SCOUT}: the rollout engine '{SCOUT}' lacks the capability "
                           "moe_weights, which the MoE model qwen3_moe needs (a test engine)"), line
    line = _exit_2_line(capsys, ["--config", GRPO, *data_args, f"{ARR}.rollout.name={SCOUT}", "trainer.use_v1=true",
                                 "trainer.v1.trainer_mode=colocate_async"])
    assert f"'{SCOUT}' lacks the capability partial_rollout, which trainer.v1.trainer_mode=colocate_async" in line
    # The built-in engine with the same constructors declares them all: the same configs pass.
    load_config(MOE, [*data_args, f"{ARR}.rollout.name=native", f"{ARR}.actor.router_replay.mode=R3",
                      f"{ARR}.rollout.enable_rollout_routing_replay=true"])
    line = _exit_2_line(capsys, ["--config", MOE, *data_args, f"{ARR}.rollout.name={SCOUT}",
                                 f"{ARR}.actor.router_replay.mode=R3",
                                 f"{ARR}.rollout.enable_rollout_routing_replay=true"])
    assert line == (f"{ARR}.rollout.name={SCOUT}: the rollout engine '{SCOUT}' lacks the capability routing_recording, "
                    f"which {ARR}.rollout.enable_rollout_routing_replay=true needs"), line


def test_an_unknown_engine_is_refused_listing_the_registered_ones(scout, data_args):
    with pytest.raises(ConfigError, match=rf"{ARR}.rollout.name: expected one of \['native', 'sglang', 'vllm', "
                                          rf"'{SCOUT}', 'hf', 'trtllm'\], found 'nope'"):
        load_config(GRPO, [*data_args, f"{ARR}.rollout.name=nope"])
    unregister_rollout(SCOUT)
    with pytest.raises(ConfigError, match=f"found '{SCOUT}'"):
        load_config(GRPO, [*data_args, f"{ARR}.rollout.name={SCOUT}"])
    # A refused name keeps its reason (no engine of that name is registered).
    with pytest.raises(ConfigError, match="verl-hpc's rollouts are native, sglang and vllm"):
        load_config(GRPO, [*data_args, f"{ARR}.rollout.name=trtllm"])


def test_require_capability_names_the_engine_and_the_capability():
    require_capability("native", "routing_recording", "x")
    with pytest.raises(RolloutCapabilityError) as err:
        require_capability("sglang", "routing_recording", f"{ARR}.rollout.enable_rollout_routing_replay=true")
    assert str(err.value) == (f"{ARR}.rollout.name=sglang: the rollout engine 'sglang' lacks the capability "
                              f"routing_recording, which {ARR}.rollout.enable_rollout_routing_replay=true needs (the "
                              "native engine records routing here: use native)")
    with pytest.raises(ValueError, match="capability: expected one of"):
        require_capability("native", "teleport", "x")


def test_verl_generate_and_the_trainer_build_a_registered_engine(scout, tmp_path):
    from verl.engine.rollout.native.engine import NativeRollout
    from verl.trainer.main_generation import main

    path = save_tiny_model("qwen2", str(tmp_path / "qwen2"))
    outputs = {}
    for name in ("native", SCOUT):
        out = tmp_path / f"{name}.json"
        argv = ["--engine", name, "--model", path, "--max-new-tokens", "5", "--temperature", "0",
                "--input-ids", "3,4,5", "--input-ids", "7", "--json", str(out)]
        assert main(argv) == 0
        outputs[name] = json.loads(out.read_text())
    assert outputs[SCOUT] == outputs["native"] and len(outputs["native"]["output_ids"][0]) == 5
    # The trainer's constructor (the colocated worker's and the pool's): the section's dtype and routing flag.
    config = ModelConfig.from_pretrained(path)
    section = type("Rollout", (), {"dtype": "bfloat16", "enable_rollout_routing_replay": True})()
    site = RolloutSite(config, path, None, (0,), 0, pad_token_id=0, seed=0, bucket_bytes=1 << 20, max_rows=4,
                       max_seq_len=16)
    engine = rollout_engine(SCOUT).build(section, site)
    assert isinstance(engine, NativeRollout) and engine.record_routing is True
    assert engine.weight_buffer().dtype == torch.bfloat16
    assert engine.weight_buffer().numel() == sum(s.numel for s in rollout_param_specs(config, 1, 0))


def test_registration_rules():
    native = rollout_engine("native")
    with pytest.raises(ValueError, match="already registered"):
        register_rollout(native)
    with pytest.raises(ValueError, match=f"expected vocab_padding={ROLLOUT_VOCAB_PADDING}"):
        register_rollout(dataclasses.replace(native, name="padded_128", capabilities=dataclasses.replace(
            native.capabilities, vocab_padding=128)))
    with pytest.raises(ValueError, match="built-in"):
        unregister_rollout("sglang")
    with pytest.raises(ValueError, match="expected capabilities in lacks"):
        RolloutEngine("x", native.capabilities, native.build, native.open_standalone, lacks={"speed": "slow"})
    # The built-ins hold the layout's padding (they are added without register_rollout's check).
    assert {registry.rollout_capabilities(n).vocab_padding for n in registry.BUILTIN_ROLLOUTS} == \
        {ROLLOUT_VOCAB_PADDING}
    assert registry.rollout_capabilities("sglang").group_backend == "gloo"
    assert registry.rollout_capabilities("native").group_backend is None


def test_the_registry_and_the_config_sections_import_without_torch():
    code = ("import sys\n"
            "import verl.engine.rollout.registry as r\n"
            "assert r.rollout_names() == ('native', 'sglang', 'vllm'), r.rollout_names()\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------ the model spec's shapes
LAYOUT_CASES = [
    ("qwen2 tied", dict(MODELS["qwen2"], max_position_embeddings=128), (1, 2, 4)),
    ("llama padded vocab", dict(MODELS["llama"], max_position_embeddings=128), (1, 2, 4)),
    ("qwen3_moe", MOE_CONFIGS["qwen3_moe"], (1, 2, 4)),
    ("mixtral", MOE_CONFIGS["mixtral"], (1, 2, 4)),
]


@pytest.mark.parametrize("label,fields,tps", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_the_spec_shapes_are_the_shapes_the_reshard_layout_places(label, fields, tps):
    config = ModelConfig.from_dict(dict(fields))
    shapes = hf_tensor_shapes(config)
    for tp in tps:  # tp 4 > 2 KV heads: each KV head replicated on two ranks
        for rank in range(tp):
            layout = [(p.name, local_shape(p, shapes, tp, rank)) for p in RolloutLayout(tp).params(config)]
            assert [(s.name, s.shape) for s in rollout_param_specs(config, tp, rank)] == layout, (label, tp, rank)
    with pytest.raises(RolloutLayoutError, match="rollout tp rank: expected 0 <= rank < 2, found 2"):
        rollout_param_specs(config, 2, 2)
    with pytest.raises(RolloutLayoutError, match="rollout tp=3: expected a divisor"):
        rollout_param_specs(config, 3, 0)


def test_the_rollout_engines_read_their_shapes_from_the_model_spec():
    engines = sorted((ROOT / "verl" / "engine" / "rollout").rglob("*.py"))
    assert engines
    users = [str(p.relative_to(ROOT)) for p in engines if "verl.hybrid_engine.rollout_layout" in p.read_text()]
    # native/weights.py cuts HF tensors by the rollout layout's pieces (layouts.fill_local), not by its shapes.
    assert users == ["verl/engine/rollout/native/weights.py"], users


# ------------------------------------------------------------------ no rollout name branch
NAME = r"[\"'](?:native|sglang)[\"']"
BRANCH = re.compile(rf"(?:==|!=)\s*{NAME}|{NAME}\s*(?:==|!=)|\bin\s*[(\[{{]\s*{NAME}")
# file -> why its comparison is not a choice of rollout engine.
ALLOWED = {
    "verl/bench/reshard.py": "`verl bench reshard --push sglang`: the bench's own flag (its one choice) times the "
                             "SGLang group's push after the reshard; it is not the trainer's rollout config",
    "verl/tools/tool_registry.py": "a tool's `config.type` in verl's tool config (native Python tools), not a rollout",
}


def test_no_rollout_engine_is_picked_by_name_outside_the_rollout_package():
    files = sorted(p for d in ("verl", "launch") for p in (ROOT / d).rglob("*.py"))
    found = []
    for path in files:
        rel = str(path.relative_to(ROOT))
        if rel.startswith("verl/engine/rollout/") or rel in ALLOWED:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        found += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(lines, 1) if BRANCH.search(line)]
    assert not found, "rollout engines picked by name (ask verl.engine.rollout.registry):\n" + "\n".join(found)
    for rel in ALLOWED:  # an allowance that no longer matches anything is dropped
        assert any(BRANCH.search(line) for line in (ROOT / rel).read_text(encoding="utf-8").splitlines()), rel


@pytest.mark.parametrize("line", [
    '    if rollout["name"] == "sglang":',
    "        use_sglang = arr.rollout.name == 'sglang'",
    '    if rollout["name"] != "native":',
    '        if args.engine in ("native", "sglang"):',
    '    if "sglang" == name:',
])
def test_the_pattern_catches_the_branches_this_test_removed(line):
    assert BRANCH.search(line)


def test_the_pool_builds_its_engine_with_the_registry_and_the_configured_bucket(data_args):
    """The standalone pool's engine comes from the same constructor as the colocated worker's, with the reshard's
    configured bucket (the pool once passed SGLang a literal 4 MiB)."""
    from verl.workers import rollout_pool

    sites = []
    native = rollout_engine("native")
    register_rollout(dataclasses.replace(native, name="recording", build=lambda section, site: sites.append(
        (section, site)) or "engine"))
    try:
        config = load_config(GRPO, [*data_args, f"{ARR}.rollout.name=recording"])
        _, engine = rollout_pool._engine(config, None, 1, None, (2, 3), 12345)
    finally:
        unregister_rollout("recording")
    (section, site), = sites
    assert engine == "engine" and section.name == "recording"
    assert (site.bucket_bytes, site.pool, site.replica, site.group_ranks) == (12345, True, 1, (2, 3))
    assert site.max_rows == config.data.train_batch_size * config.actor_rollout_ref.rollout.n


def test_vllm_tp_limits_are_one_line_before_vllm_starts(monkeypatch):
    """vLLM at rollout TP > 1 (tests/vllm: the external launcher, a TP worker per trainer rank): a standalone pool
    cannot host it (vLLM builds its groups over every rank of the job, and the training ranks build no engine), nor can
    a rollout TP group of interleaved ranks (vLLM's groups are consecutive ranks), nor a mixture of experts."""
    import os
    import types

    import torch.distributed as dist

    from verl.engine.rollout.registry import RolloutSite, rollout_engine
    from verl.engine.rollout.vllm.engine import VLLMConfigError, check_tp_group, check_vllm_model
    from verl.models.config import ModelConfig

    site = RolloutSite(model_config=None, model_path="unused", tp_group=object(), group_ranks=(2, 3), replica=0,
                       pad_token_id=0, seed=0, bucket_bytes=1, max_rows=1, max_seq_len=8, pool=True)
    with pytest.raises(VLLMConfigError, match="a standalone rollout pool runs vLLM at TP 1"):
        rollout_engine("vllm").build(types.SimpleNamespace(), site)
    models = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models")
    moe = ModelConfig.from_pretrained(os.path.join(models, "qwen3moe_tiny_arith.json"))
    with pytest.raises(VLLMConfigError, match="mixture of experts runs TP 1"):
        check_vllm_model(moe, 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 2])
    with pytest.raises(VLLMConfigError, match=r"consecutive ranks \[k\*2, \(k\+1\)\*2\), found the rollout TP "
                                              r"group \[0, 2\]"):
        check_tp_group(object())
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [2, 3])
    assert check_tp_group(object()) == (2, 0)
