"""Backends own their branches: outside their folders (``verl/engine/<backend>/``, and Megatron's model in
``verl/models/mcore/``) nothing asks which training backend runs. They read the engine contract
(``TrainingEngine.bind_reshard`` / ``reshard_sources`` / ``training_layout`` / ``lora_sync_source``), the layouts'
own methods, and the backend's config rules found by strategy name (``verl.engine.strategies.config_rules``)."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# All of verl/ but the backends' own folders, constants included (a backend name in a table outside them is a
# branch waiting to happen).
BACKEND_FOLDERS = ("verl/engine/megatron", "verl/engine/fsdp",
                   # Megatron's model: the spec's mcore names, weight rules and GPTModel builder, which the
                   # hybrid engine's layouts and the memory model read as the model layer below the engines
                   "verl/models/mcore")
BACKEND = r"[\"'](?:megatron|fsdp2?|dp)[\"']"
# What a backend branch looks like, by kind.
PATTERNS = {
    "is_fsdp": re.compile(r"\bis_fsdp\b|\bFSDP_STRATEGIES\b|\bFSDP_ENGINE\b"),
    "isinstance on a training layout": re.compile(r"isinstance\([^)]*\b(?:FSDPLayout|TrainingLayout)\b"),
    "a strategy or engine compared to a backend name": re.compile(
        rf"(?:strategy|engine|backend)\w*(?:\([^)]*\))?[\"'\])]*\s*(?:==|!=|\bin\b)\s*[(\[{{]?\s*{BACKEND}|{BACKEND}\s*(?:==|!=)"),
    "a megatron-core import": re.compile(r"^\s*(?:from|import)\s+megatron\b"),
    # imported, or named in a string (an import path); a docstring's :mod: reference is no branch
    "a backend's engine module": re.compile(r"(?:\b(?:from|import)\s+|[\"'])verl\.engine\.(?:megatron|fsdp)\b"),
    "Megatron DDP internals": re.compile(r"\bexpert_parallel_buffers\b|\bparam_data\b"),
    "a private hybrid-engine call": re.compile(r"\bHybridEngine\._"),
}
# (file, kind) -> why it is not a backend branch of the PPO stack.
ALLOWED = {
    ("verl/trainer/main_generation.py", "a strategy or engine compared to a backend name"):
        "`verl generate --engine megatron` picks a generator among the CLI's --engine choices (Megatron's own "
        "sampler beside the rollout engines), not the training backend of a role",
    ("verl/trainer/main_generation.py", "a backend's engine module"):
        "the --engine megatron generator's entry point (verl.engine.megatron.generate), imported when chosen",
    ("verl/trainer/sft_trainer.py", "a megatron-core import"):
        "`verl sft` runs on Megatron only: its trainer is not one of the PPO roles (issue 42 item 5 moves it onto "
        "the engine registry)",
    ("verl/trainer/sft_trainer.py", "a backend's engine module"):
        "`verl sft` runs on Megatron only (see above)",
    ("verl/engine/strategies.py", "a backend's engine module"):
        "the one engine table: each engine's class by import path",
    ("verl/cli.py", "a backend's engine module"):
        "`verl convert` is Megatron's checkpoint converter (hf-to-mcore, mcore-to-hf), a subcommand by module path",
    ("verl/models/hf_export.py", "a megatron-core import"):
        "the Megatron model's HF export (streamed over its TP/PP group), shared by `verl sft`, `verl convert` and "
        "the Megatron engine; the FSDP engine's is verl/engine/fsdp/hf_export.py",
    ("verl/utils/checkpoint.py", "a megatron-core import"):
        "the trainer's RNG state includes Megatron's model-parallel RNG tracker when this process initialised "
        "Megatron (checked in sys.modules first, so an FSDP run never imports it)",
    ("verl/utils/env_check.py", "a megatron-core import"):
        "`verl check-env` reports the installed megatron-core version",
    ("verl/bench/reshard.py", "a backend's engine module"):
        "`verl bench reshard --train fsdp` measures the FSDP engine's own reshard sources against a memcpy",
    ("verl/bench/weight_sync.py", "isinstance on a training layout"):
        "the cross-pool bench builds each backend's training shards itself (no engine), by layout kind",
    ("verl/models/layout_choice.py", "a strategy or engine compared to a backend name"):
        "the auto layout weighs the two engines' memory models against each other and writes the chosen engine's "
        "own keys",
}


def _hits(text: str) -> list[tuple[int, str]]:
    return [(n, kind) for n, line in enumerate(text.splitlines(), 1)
            for kind, pattern in PATTERNS.items() if pattern.search(line)]


def test_no_backend_branch_outside_the_engines():
    files = sorted(f for f in (ROOT / "verl").rglob("*.py")
                   if not any(f.is_relative_to(ROOT / folder) for folder in BACKEND_FOLDERS))
    assert len(files) > 200
    found = [f"{rel}:{n}: {kind}" for path in files for rel in [str(path.relative_to(ROOT))]
             for n, kind in _hits(path.read_text(encoding="utf-8")) if (rel, kind) not in ALLOWED]
    assert not found, "backend branches outside the backends' folders:\n" + "\n".join(found)


@pytest.mark.parametrize("line, kind", [
    ("    unused = (\"megatron\",) if is_fsdp(cfg) else (\"fsdp_config\", \"grad_clip\")", "is_fsdp"),
    ("        if isinstance(training, FSDPLayout):", "isinstance on a training layout"),
    ("    fsdp = isinstance(training, (TrainingLayout, FSDPLayout))", "isinstance on a training layout"),
    ("    if strategy == \"megatron\":", "a strategy or engine compared to a backend name"),
    ("    if section[\"strategy\"] in (\"fsdp\", \"fsdp2\"):", "a strategy or engine compared to a backend name"),
    ("    backend = \"dp\" if engine_name(s) == \"fsdp\" else 1", "a strategy or engine compared to a backend name"),
    ("            from megatron.core import parallel_state as mpu", "a megatron-core import"),
    ("            from verl.engine.fsdp.reshard import fsdp_reshard_sources", "a backend's engine module"),
    ("        buffers = [*(getattr(engine.model, \"expert_parallel_buffers\", None) or [])]", "Megatron DDP internals"),
    ("            bound = HybridEngine._bind_training_buffer(engine, model_config, training, mpu)",
     "a private hybrid-engine call"),
])
def test_the_patterns_catch_the_branches_this_test_removed(line, kind):
    assert (1, kind) in _hits(line)


def test_every_strategy_has_torch_free_config_rules_that_agree_with_the_loader():
    code = ("import sys\n"
            "from verl.engine.strategies import STRATEGIES, config_rules, engine_name\n"
            "from verl.engine.config_rules import BackendConfigRules\n"
            "rules = {name: config_rules(name) for name in STRATEGIES}\n"
            "assert all(isinstance(r, BackendConfigRules) for r in rules.values()), rules\n"
            "assert all(rules[a] is rules[b] for a in STRATEGIES for b in STRATEGIES "
            "if engine_name(a) == engine_name(b))\n"
            "assert 'torch' not in sys.modules\n"
            "from verl.engine.strategies import engine_entry\n"
            "print(sorted({(engine_entry(s).model_engine, engine_name(s)) for s in rules}))\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True).stdout
    from verl.trainer.config.ppo import MODEL_ENGINES

    # verl's model_engine selector and each backend's rules name the same pairs.
    assert out.strip() == str(sorted((engine, strategy) for engine, (_, strategy) in MODEL_ENGINES.items()))


def test_the_engines_supply_the_reshard_sources():
    from verl.engine.base import TrainingEngine
    from verl.engine.fsdp.engine import FSDPEngine
    from verl.engine.megatron.engine import MegatronEngine

    # Each backend says how it reads its weights (reshard_readers); the base turns that into reshard_sources (dense
    # or LoRA-merged) and lora_sync_source for every engine alike.
    needed = {"training_layout", "bind_reshard", "reshard_readers"}
    assert needed <= TrainingEngine.__abstractmethods__
    assert callable(TrainingEngine.reshard_sources) and callable(TrainingEngine.lora_sync_source)
    for cls in (FSDPEngine, MegatronEngine):
        assert not needed & cls.__abstractmethods__, cls
