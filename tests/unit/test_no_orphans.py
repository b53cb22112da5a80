"""No process outlives its rank (issue 56, fault 12 / build item 7). A rank-like process does what a trainer rank
does that starts children: a Megatron checkpoint save (dist_checkpointing), a reward pool (spawned workers; a
SIGKILLed rank's in tests/unit/test_reward_pool.py) and a dataloader with a worker (forked); it lists its process
tree, then ends as a rank ends (``exit_process``, the interpreter's teardown skipped, as ``verl train``'s ranks and
so every sbatch/srun/local-launcher job end) or is SIGKILLed (a killed run). Within a bound, nothing of that tree
is left.

Was: dist_checkpointing's spawn-context Manager (a server process per rank, ~330 MB) stayed behind after every job
whose ranks had saved a Megatron checkpoint, its parent pid 1, forever."""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.tiny_models import alive_pids

pytest.importorskip("megatron.core")

RANK = '''
import os, pickle, sys, time

import psutil
import torch

if __name__ == "__main__":  # spawned children import this file again
    mode, root = sys.argv[1], sys.argv[2]
    import torch.distributed as dist
    from helpers.megatron_tiny_models import hf_model, model_config, save_hf

    from verl.engine.megatron.checkpoint import save_checkpoint
    from verl.engine.megatron.engine import MegatronEngine
    from verl.engine.megatron.parallel import initialize_megatron
    from verl.launcher.bootstrap import exit_process
    from verl.trainer.ppo.data import rl_dataloader
    from verl.workers.reward_manager.async_pool import RewardPool

    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=0, world_size=1)
    initialize_megatron(1, 1, seed=1)
    hf_dir = save_hf(hf_model("llama_gqa_untied", seed=1), os.path.join(root, "hf"), sharded=False)
    engine = MegatronEngine(model_config(hf_dir), optim=None)
    save_checkpoint(engine, os.path.join(root, "ckpt"), iteration=1, with_optimizer=False)
    if mode == "exit":  # (a SIGKILLed rank's pool: tests/unit/test_reward_pool.py)
        pool = RewardPool(pickle.load(open(os.path.join(root, "manager.pkl"), "rb")), num_workers=1)
        pool.wait_ready()
    batches = iter(rl_dataloader([{"x": torch.zeros(2)} for _ in range(8)], batch_size=2, num_workers=1))
    next(batches)  # its worker is up, a batch ahead
    print(" ".join(str(p.pid) for p in psutil.Process().children(recursive=True)), flush=True)
    if mode == "exit":
        exit_process(0)
    time.sleep(600)
'''


@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_nothing_of_a_ranks_process_tree_outlives_it(tmp_path, end):
    import pickle

    from transformers import AutoTokenizer

    from verl.utils.dataset.arithmetic import build_char_tokenizer
    from verl.workers.reward_manager import NaiveRewardManager

    tok = AutoTokenizer.from_pretrained(build_char_tokenizer(str(tmp_path / "tok")))
    (tmp_path / "manager.pkl").write_bytes(pickle.dumps(NaiveRewardManager(tok)))
    (tmp_path / "rank.py").write_text(RANK)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    rank = subprocess.Popen([sys.executable, str(tmp_path / "rank.py"), end, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    tree: list[int] = []
    try:
        line = rank.stdout.readline()
        assert line.strip(), f"the rank did not list its children:\n{rank.stderr.read()[-3000:]}"
        tree = [int(p) for p in line.split()]
        assert len(tree) >= (2 if end == "exit" else 1)  # the reward worker, the dataloader's worker
        if end == "sigkill":
            rank.send_signal(signal.SIGKILL)
        assert rank.wait(timeout=60) == (0 if end == "exit" else -signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive_pids(tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = alive_pids(tree)
        if left:
            import psutil

            described = [" ".join(psutil.Process(p).cmdline())[:160] for p in left]
        assert not left, f"processes of the rank's tree outlived it ({end}): {described}"
    finally:
        rank.kill()
        rank.wait()
        for pid in alive_pids(tree):  # a failing run leaves nothing behind either
            os.kill(pid, signal.SIGKILL)
