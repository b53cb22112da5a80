"""The rollout contract is complete: what the worker, the pool, the agent stream and the trainer call on a rollout
engine or its token server is declared on :class:`BaseRollout` / :class:`BaseTokenServer` (with a default where
optional), every built-in engine and server subclasses them, and no caller probes for a method with
``getattr``/``hasattr`` (issue 54 item 4)."""

import ast
import pathlib

import pytest

from verl.engine.rollout.base import BaseRollout
from verl.engine.rollout.token_server import BaseTokenServer

pytestmark = pytest.mark.unit
ROOT = pathlib.Path(__file__).resolve().parents[2]
CALLERS = ("verl/workers", "verl/trainer", "verl/hybrid_engine", "verl/api")
# the names the callers hold a rollout engine or a token server under
HOLDERS = {"rollout", "engine", "server", "_server"}


def _probes(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = node.args[0] if node.args else None
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
            if name in HOLDERS and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                found.append((node.lineno, f"{node.func.id}({name}, {node.args[1].value!r})"))
    return found


def test_no_caller_probes_a_rollout_engine_or_token_server():
    files = sorted(f for package in CALLERS for f in (ROOT / package).rglob("*.py"))
    found = [f"{path.relative_to(ROOT)}:{n}: {probe}" for path in files
             for n, probe in _probes(ast.parse(path.read_text(encoding="utf-8")))]
    assert not found, "probes for undeclared rollout methods:\n" + "\n".join(found)


def test_the_probe_scan_catches_a_probe():
    assert _probes(ast.parse("stop = getattr(self.rollout, 'shutdown', None)")) == [(1, "getattr(rollout, 'shutdown')")]
    assert _probes(ast.parse("x = hasattr(engine, 'is_owner')")) == [(1, "hasattr(engine, 'is_owner')")]


def test_the_contract_declares_what_callers_use():
    for name in ("generate_responses", "generate", "generate_sequences", "load_weights", "weight_buffer",
                 "push_weights", "swap_weight_buffer", "token_server", "release", "resume", "shutdown",
                 "resident_tensors", "is_owner", "owner_generates", "swaps_weight_buffer"):
        assert hasattr(BaseRollout, name), name
    for name in ("generate", "run", "interrupt", "resume_turns", "follow", "release", "close", "drop_prefix_cache",
                 "calls", "busy", "loop"):
        assert hasattr(BaseTokenServer, name), name


def test_built_in_engines_and_servers_implement_the_bases():
    from verl.engine.rollout.native.engine import NativeRollout
    from verl.engine.rollout.native.token_server import TokenServer
    from verl.engine.rollout.sglang_group import SGLangGroupRollout
    from verl.engine.rollout.sglang_rollout import SGLangRollout
    from verl.engine.rollout.sglang_token_server import SGLangTokenServer

    for cls in (NativeRollout, SGLangGroupRollout, SGLangRollout):
        assert issubclass(cls, BaseRollout) and not cls.__abstractmethods__, cls
    for cls in (TokenServer, SGLangTokenServer):
        assert issubclass(cls, BaseTokenServer) and not cls.__abstractmethods__, cls
    assert NativeRollout.swaps_weight_buffer and not SGLangGroupRollout.swaps_weight_buffer
    assert SGLangGroupRollout.owner_generates and not NativeRollout.owner_generates


def test_a_minimal_engine_gets_the_optional_methods_as_defaults():
    import torch

    from verl.models.config import ModelConfig

    class Minimal(BaseRollout):
        def generate_responses(self, input_ids, attention_mask, sampling_params, pad_token_id):
            raise NotImplementedError

        def load_weights(self, named_tensors):
            self.loaded = dict(named_tensors)

        def release(self):
            pass

        def resume(self):
            pass

    config = ModelConfig.from_dict(dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True, max_position_embeddings=64))
    engine = Minimal(config)
    assert engine.is_owner and not engine.swaps_weight_buffer and engine.resident_tensors() == []
    engine.shutdown()  # optional: a no-op
    with pytest.raises(NotImplementedError, match="agent_loop"):
        engine.token_server(None)
    with pytest.raises(NotImplementedError, match="swaps_weight_buffer"):
        engine.swap_weight_buffer(torch.zeros(1))
