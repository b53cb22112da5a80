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
