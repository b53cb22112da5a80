"""Helpers of the trainer's SGLang rollout that need no SGLang: core split, the engine's model directory,
signal dispositions its processes inherit, the rendezvous port, bucket ranges."""

import json
import signal
import socket
import subprocess
import sys

import pytest

from verl.engine.rollout.sglang_group import (
    RANK_SIGNALS,
    engine_model_dir,
    free_port_below_ephemeral,
    owner_cpus,
    signals_ignored_by_children,
)
from verl.engine.rollout.sglang_rollout import bucket_ranges, cpu_threads_bind


@pytest.mark.parametrize("cpus, groups, want", [
    (range(16), 2, [list(range(8)), list(range(8, 16))]),
    (range(2), 2, [[0], [1]]),
    (range(1), 2, [[0], [0]]),          # fewer cores than engines: they share
    (range(5), 2, [[0, 1], [2, 3]]),    # the odd core is left to the trainer
])
def test_engines_get_disjoint_core_blocks(cpus, groups, want):
    assert [owner_cpus(g, groups, list(cpus)) for g in range(groups)] == want


def test_each_sglang_tp_rank_binds_to_its_share_of_the_engine_cores():
    assert cpu_threads_bind(2, owner_cpus(1, 2, list(range(8)))) == "4-5|6-7"
    assert cpu_threads_bind(1, [3]) == "3"


def test_a_bare_config_json_becomes_an_hf_directory(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 8}
    (tmp_path / "model.json").write_text(json.dumps(cfg))
    out = engine_model_dir(str(tmp_path / "model.json"), str(tmp_path / "engine_model"))
    assert json.loads((tmp_path / "engine_model" / "config.json").read_text()) == cfg
    assert engine_model_dir(out, str(tmp_path / "unused")) == out  # a directory is used as it is
    assert not (tmp_path / "unused").exists()


def test_processes_started_inside_inherit_the_rank_signals_ignored():
    probe = "import signal, sys; print(all(signal.getsignal(s) == signal.SIG_IGN for s in map(int, sys.argv[1:])))"
    before = {sig: signal.getsignal(sig) for sig in RANK_SIGNALS}
    with signals_ignored_by_children():
        inside = subprocess.run([sys.executable, "-c", probe, *[str(int(s)) for s in RANK_SIGNALS]],
                                capture_output=True, text=True, check=True).stdout.strip()
    after = subprocess.run([sys.executable, "-c", probe, str(int(signal.SIGUSR1))], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert inside == "True" and after == "False"
    assert {sig: signal.getsignal(sig) for sig in RANK_SIGNALS} == before  # this process's handlers are back


def test_rendezvous_ports_are_free_and_not_drawn_from_the_seeded_global_generator():
    import random

    random.seed(0)
    first = free_port_below_ephemeral()
    random.seed(0)
    draws = {free_port_below_ephemeral() for _ in range(5)} | {first}
    assert len(draws) > 1  # the same global seed does not give every rank the same port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", first))


@pytest.mark.parametrize("numel, per, want", [
    (10, 4, [(0, 4), (4, 8), (8, 10)]), (8, 4, [(0, 4), (4, 8)]), (3, 16, [(0, 3)]), (0, 4, []),
])
def test_bucket_ranges_cover_the_buffer_once(numel, per, want):
    assert bucket_ranges(numel, per) == want


def test_a_handle_is_metadata_and_opens_the_same_shared_memory():
    import pickle

    import torch
    import torch.multiprocessing

    from verl.engine.rollout.sglang_rollout import serialize_handle

    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        flat = torch.zeros(1 << 20).share_memory_()  # 4 MiB
        handle = serialize_handle(flat[1024:2048])
        assert len(handle) < 1024  # a name and offsets, not the 4 KiB of the slice
        view = pickle.loads(handle)
        flat[1024:2048] = 7.0
        assert view.shape == (1024,) and bool((view == 7.0).all())  # the same memory, not a copy
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def _rollout_config(model_path, tp):
    from omegaconf import OmegaConf

    return OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(model_path)}, "rollout": {
        "name": "sglang", "tensor_model_parallel_size": tp}}})


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="SGLang replicates KV heads on GPUs")
def test_preflight_refuses_a_cpu_rollout_tp_sglang_would_pad(tmp_path, monkeypatch):
    import verl.utils.engine_env as engine_env
    from verl.trainer.preflight import PreflightError, check_rollout_engine

    monkeypatch.setattr(engine_env, "importable", lambda package: True)
    cfg = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1}
    (tmp_path / "model.json").write_text(json.dumps(cfg))
    check_rollout_engine(_rollout_config(tmp_path / "model.json", 1))
    with pytest.raises(PreflightError, match=r"tensor_model_parallel_size: rollout tp=2 on CPU: expected a tp "
                                             r"dividing num_key_value_heads=1"):
        check_rollout_engine(_rollout_config(tmp_path / "model.json", 2))
