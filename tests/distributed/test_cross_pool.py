"""A standalone rollout pool (issue 30): the cross-pool weight sync on gloo ranks, and `verl train` with
``actor_rollout_ref.rollout.nnodes=1``.

Transfer level (every rank builds the same seeded weights; rollout ranks compare with the shard cut straight
from them): the bench's matrix of layouts is bit-exact, its JSON meets the bytes formula, a sparse delta stays
bit-identical over several optimizer steps and across a restart of both sides, and a corrupted bucket is one
error naming the bucket and both ranks.

Trainer level: the quickstart's GRPO with 2 training ranks + 2 pool ranks is the colocated run step for step
(same samples, same losses, same greedy validation: the pool generates with exactly the actor's weights after
every update); FSDP with a bf16 pool and delta syncs trains with verified buckets, and a preemption there
checkpoints and exits 0; a pool rank killed in the middle of a transfer ends the job within a bound, with one
line naming it.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402
from helpers.tolerance import rounding_log_prob_gap  # noqa: E402
from helpers.train_runs import REPO, deterministic, read_metrics, run_train, train_cmd, train_env  # noqa: E402

from verl.bench.weight_sync import separate_rank  # noqa: E402
from verl.launcher.spawn import run_ranks_with_rank  # noqa: E402
from verl.models.config import ModelConfig  # noqa: E402

MODEL = os.path.join(REPO, "configs", "models", "qwen2_tiny_arith.json")
# How far past bf16's own rounding of the model (tests/helpers/tolerance.py: rounding_log_prob_gap) a bf16 pool's
# log-probs may sit from the fp32 actor's.
BF16_ROLLOUT_MARGIN = 4.0
POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
        "trainer.n_gpus_per_node=2"]


def _cfg():
    import dataclasses

    return dataclasses.asdict(ModelConfig.from_pretrained(MODEL))


# ------------------------------------------------------------------------------------------- transfer level
def test_bench_separate_is_verified_meets_the_formula_and_reports_the_delta(tmp_path):
    out = tmp_path / "sep.json"
    proc = subprocess.run(
        [sys.executable, "-m", "verl.cli", "bench", "reshard", "--model", MODEL, "--train", "tp=2,pp=1,dp=1",
         "--rollout", "tp=1", "--rollout-replicas", "2", "--placement", "separate", "--nproc", "4",
         "--dtype", "bfloat16", "--bucket-bytes", str(32 << 10), "--repeats", "1", "--delta-after-steps", "2",
         "--json", str(out)], cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["verified"] and r["naive_verified"] and r["bucketed_verified"] and r["delta_verified"]
    assert r["bucketed_seconds"] > 0 and r["bucketed_over_seconds"] > 0
    assert r["bytes_received_equals_formula"], (r["bytes_received_per_rank"], r["bytes_formula"])
    assert len(r["bytes_received_per_rank"]) == 2 and len(r["bytes_sent_per_rank"]) == 2
    assert sum(r["bytes_sent_per_rank"]) == sum(r["bytes_received_per_rank"])
    assert r["bytes_sent_max_over_mean"] <= 1.1
    assert r["peak_extra_bytes_training"] <= 2 * (32 << 10)  # two buckets in flight at most
    # lr 1e-6 on std-0.02 weights changes a few percent of the bf16 values per step: the delta pays.
    assert 0 < r["delta_fraction"] < 0.6
    assert "bytes formula: received by rollout rank" in proc.stdout


@pytest.mark.parametrize("train,tg,replicas", [
    ({"tp": 1, "pp": 2, "dp": 1}, 2, 1),
    ({"tp": 1, "pp": 1, "dp": 2}, 2, 1),
    ({"fsdp": 2}, 1, 2),
    ({"tp": 1, "pp": 1, "dp": 1}, 1, 2),
], ids=["megatron-pp2-to-tp2", "megatron-dp2-to-tp2", "fsdp2-to-tp1x2", "megatron-tp1-to-tp1x2-forwarded"])
def test_layouts_arrive_bit_exact(train, tg, replicas):
    n = (train.get("fsdp") or train["tp"] * train["pp"] * train["dp"]) + tg * replicas
    ranks = run_ranks_with_rank(separate_rank, n, _cfg(), train, tg, replicas, "bfloat16", 16 << 10, 3, 1, False,
                                timeout_s=240, threads_per_rank=1)
    rollout = [r for r in ranks if r["role"] == "rollout"]
    assert len(rollout) == tg * replicas and all(r["verified"] for r in rollout)
    formula = ranks[0]["formula"]
    assert [r["bytes"] for r in rollout] == formula["received_per_rank"]
    assert [r["forwarded"] for r in rollout] == formula["forwarded_per_rank"]
    assert any(formula["forwarded_per_rank"]) == (tg * replicas > n - tg * replicas and replicas > 1)


def _delta_rounds(rank, nproc, cfg):
    """Three optimizer steps with delta syncs, then both sides start over (a resume: empty caches, zeroed
    rollout buffers) and sync twice more; after every sync the rollout equals its reference bit for bit."""
    import math

    import torch.distributed as dist

    from verl.bench.reshard import random_hf_weights, reference_rollout_shard
    from verl.bench.weight_sync import INIT_STD, adam_steps, training_shard
    from verl.hybrid_engine.cross_pool import PoolPlacement, plan_cross_pool
    from verl.hybrid_engine.layouts import TrainingLayout
    from verl.hybrid_engine.rollout_layout import rollout_param_specs
    from verl.hybrid_engine.weight_sync import PoolReceiver, PoolSender
    from verl.launcher.pools import Bridge

    config = ModelConfig.from_dict(cfg)
    placement = PoolPlacement(TrainingLayout(2, 1, 1), 1, 1)
    bridge = Bridge(dist.distributed_c10d._get_default_group(), rank, nproc)
    plan = plan_cross_pool(config, placement, rank, 16 << 10, "bfloat16")
    hf = {n: t * INIT_STD for n, t in random_hf_weights(config, 5).items()}
    specs = [(s.name, s.shape) for s in rollout_param_specs(config, 1, 0)]
    state = {}

    def start():
        if rank < 2:
            state["source"], state["offsets"] = training_shard(config, placement.training, rank, hf, torch.bfloat16)
            state["sender"] = PoolSender(plan, state["source"], state["offsets"], bridge, verify=True, delta=True)
        else:
            state["receiver"] = PoolReceiver(plan, specs, bridge, verify=True)
            state["live"], state["staging"] = (torch.zeros(state["receiver"].numel, dtype=torch.bfloat16)
                                               for _ in range(2))

    def sync():
        if rank < 2:
            stats = state["sender"].send()
            return {"bytes": stats.bytes, "dense": stats.dense_bytes}
        state["receiver"].receive(state["staging"], state["live"])
        state["live"], state["staging"] = state["staging"], state["live"]  # the swap at the step boundary
        reference = reference_rollout_shard(config, hf, 1, 0, torch.bfloat16)
        offsets = state["receiver"].offsets
        got = {n: state["live"][offsets[n]:offsets[n] + math.prod(s)].view(s) for n, s in specs}
        return {"exact": all(torch.equal(got[n], t) for n, t in reference.items())}

    def step(seed):
        adam_steps(hf, 1, 1e-6, seed)
        if rank < 2:
            training_shard(config, placement.training, rank, hf, torch.bfloat16, out=state["source"])

    start()
    records = [sync()]
    for seed in (1, 2, 3):
        step(seed)
        records.append(sync())
    start()  # a restart of both pools
    records.append(sync())
    step(4)
    records.append(sync())
    return records


def test_delta_syncs_stay_bit_identical_over_steps_and_after_a_restart():
    ranks = run_ranks_with_rank(_delta_rounds, 3, _cfg(), timeout_s=240, threads_per_rank=1)
    assert all(r["exact"] for r in ranks[2]), ranks[2]
    senders = ranks[:2]
    for s in senders:
        assert s[0]["bytes"] == s[0]["dense"], "the first sync has nothing to compare with: dense"
        assert s[4]["bytes"] == s[4]["dense"], "the first sync after a restart: dense"
        for i in (1, 2, 3, 5):
            assert 0 < s[i]["bytes"] < s[i]["dense"], (i, s[i])


def _corrupted(rank, nproc, cfg):
    """Training rank 0 announces a wrong checksum for its bucket; the rollout rank must refuse it."""
    import torch.distributed as dist

    import verl.hybrid_engine.weight_sync as ws
    from verl.bench.reshard import random_hf_weights
    from verl.bench.weight_sync import training_shard
    from verl.hybrid_engine.cross_pool import PoolPlacement, plan_cross_pool
    from verl.hybrid_engine.layouts import TrainingLayout
    from verl.hybrid_engine.rollout_layout import rollout_param_specs
    from verl.launcher.pools import Bridge

    config = ModelConfig.from_dict(cfg)
    placement = PoolPlacement(TrainingLayout(1, 1, 1), 1, 1)
    bridge = Bridge(dist.distributed_c10d._get_default_group(), rank, nproc)
    plan = plan_cross_pool(config, placement, rank, 4 << 20, "float32")  # one bucket
    if rank == 0:
        source, offsets = training_shard(config, placement.training, 0, random_hf_weights(config, 0), torch.float32)
        real = ws.checksum
        ws.checksum = lambda t: real(t) ^ 1
        ws.PoolSender(plan, source, offsets, bridge, verify=True).send()
        return None
    specs = [(s.name, s.shape) for s in rollout_param_specs(config, 1, 0)]
    receiver = ws.PoolReceiver(plan, specs, bridge, verify=True)
    try:
        receiver.receive(torch.zeros(receiver.numel))
    except ws.WeightSyncError as err:
        return str(err)
    return "no error"


def test_a_corrupted_bucket_is_one_error_naming_the_bucket_and_both_ranks():
    _, message = run_ranks_with_rank(_corrupted, 2, _cfg(), timeout_s=120, threads_per_rank=1)
    assert message.startswith("weight sync: bucket 0 from training rank 0 to rollout rank 1 (replica 0, tp rank 0): "
                              "checksum mismatch"), message
    assert "\n" not in message


# ------------------------------------------------------------------------------------------- trainer level
@pytest.fixture(scope="module")
def data_args(tmp_path_factory):
    return arithmetic_data_args(tmp_path_factory.mktemp("arith"), num_train=64, num_test=16)


@pytest.fixture(scope="module")
def length_reward(tmp_path_factory):
    """A reward every response earns some of (its length): advantages are never all zero, so every step
    moves the weights, and a missed or wrong sync would change the next step's samples."""
    path = tmp_path_factory.mktemp("reward") / "length_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return len(solution_str) / 8.0\n")
    return [f"custom_reward_function.path={path}", "custom_reward_function.name=compute_score"]


SMALL = ["trainer.total_training_steps=3", "trainer.test_freq=3", "trainer.save_freq=-1",
         "trainer.val_before_train=false", "data.train_batch_size=16", "data.val_batch_size=16",
         "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32", "actor_rollout_ref.actor.optim.lr=1e-2"]


def test_the_pool_run_is_the_colocated_run_step_for_step(tmp_path, data_args, length_reward):
    """Megatron TP2 on 2 training ranks; the rollout colocated (TP1, 2 replicas) or on a pool of 2 ranks (TP1, 2
    replicas): the same prompts reach the same replica with the same seed, so with the actor's exact weights in
    the pool both runs sample, train and validate identically."""
    runs = {}
    for name, extra in (("colocated", []), ("pool", POOL)):
        out = tmp_path / name
        run_train(train_cmd("grpo_arith_tiny.yaml", out, data_args, *length_reward, *SMALL, *extra,
                            f"trainer.validation_data_dir={out / 'val'}"))
        runs[name] = (read_metrics(out), (out / "val" / "3.jsonl").read_text())
    (colocated, val_colocated), (pool, val_pool) = runs["colocated"], runs["pool"]
    assert val_pool == val_colocated, "the pool's greedy validation differs from the colocated rollout's"
    assert sorted(pool) == sorted(colocated) == [1, 2, 3]
    for step in (1, 2, 3):
        a, b = deterministic(colocated[step]), deterministic(pool[step])
        assert a["actor/grad_norm"] > 0
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm",
                    "training/rollout_probs_diff_max"):
            assert a[key] == b[key], (step, key, a[key], b[key])
        # The pool's own figures: every sync sends each pool rank the whole model payload (t_g = 1).
        assert b["perf/weight_sync_bytes"] > 0 and b["perf/weight_sync_delta_fraction"] == 1.0
        assert "perf/weight_sync_bytes" not in a
    assert pool[3]["perf/weight_sync_bytes"] == pool[1]["perf/weight_sync_bytes"]  # dense: the same each sync


def test_fsdp_with_a_bf16_pool_trains_with_delta_syncs_and_a_preemption_checkpoints(tmp_path, data_args,
                                                                                     length_reward):
    """FSDP (fp32 master weights) into a bf16 pool with delta syncs and verified buckets; after step 3 the launcher
    gets SIGUSR1 (Slurm's preemption warning; Ctrl-C takes the same path), which reaches every rank: the training
    ranks finish the step and checkpoint, the pool ranks serve until the trainer's stop, and the job exits 0."""
    import signal

    out = tmp_path / "fsdp"
    cmd = train_cmd("grpo_arith_tiny_fsdp.yaml", out, data_args, *length_reward, *SMALL, *POOL[:1],
                    "actor_rollout_ref.rollout.n_gpus_per_node=1", "trainer.n_gpus_per_node=2",
                    "actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.actor.optim.lr=1e-6",
                    "actor_rollout_ref.rollout.checkpoint_engine.delta=true",
                    "actor_rollout_ref.rollout.checkpoint_engine.verify=true", "trainer.total_training_steps=50")
    launcher = subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and launcher.poll() is None:
            if (out / "metrics.jsonl").is_file() and 3 in read_metrics(out):
                break
            time.sleep(0.1)
        launcher.send_signal(signal.SIGUSR1)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    assert "preempted: stopped after step" in output
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").is_file()
    metrics = read_metrics(out)
    assert metrics[1]["perf/weight_sync_delta_fraction"] == 1.0  # nothing to compare with yet
    fractions = [metrics[step]["perf/weight_sync_delta_fraction"] for step in (1, 2, 3)]
    print(f"FSDP -> bf16 pool, lr 1e-6: perf/weight_sync_delta_fraction per step {fractions}")
    # The bf16 pool's log-probs against the fp32 actor's, in log-prob space: at most what running this model in
    # bf16 does to them (rounding its weights and activations; measured on the run's shapes, 8-token prompts and
    # 6-token sampled responses) times a margin for the native rollout's kernels, the sampled tokens and two
    # optimizer steps of lr 1e-6; a pool holding other weights is far above it.
    rounding = rounding_log_prob_gap(MODEL, torch.bfloat16, prompt_len=8, response_len=6)
    bound = BF16_ROLLOUT_MARGIN * rounding
    assert bound < rounding_log_prob_gap(MODEL, torch.bfloat16, prompt_len=8, response_len=6,
                                         other_seed=1) / 4
    print(f"bf16 rounding moves the tiny model's log-probs by <= {rounding:.2e}; bound {bound:.2e}; run: "
          f"{[metrics[step]['training/rollout_log_probs_diff_max'] for step in (1, 2, 3)]}")
    for step in (1, 2, 3):  # lr 1e-6: a few percent of the bf16 values change; every bucket's checksum verified
        if step > 1:
            assert 0 < metrics[step]["perf/weight_sync_delta_fraction"] < 0.9, metrics[step]
        assert 0 < metrics[step]["training/rollout_log_probs_diff_max"] <= bound, (step, metrics[step], bound)


@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_a_pool_rank_killed_during_a_transfer_ends_the_job_with_one_line(tmp_path, data_args, mode):
    """A sitecustomize on the ranks' path SIGKILLs pool rank 3 (the second pool rank) when a sync's first bucket
    has arrived (the training ranks are sending the other buckets) after step 1 was logged: the job must end
    within the bound after the kill, naming rank 3. ``separate_async``: the pool is streaming (generating between
    syncs, results flowing to training rank 0 on threads), and it syncs once more, before step 1."""
    kill_at = 2 if mode == "sync" else 3
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '3':\n"
        "    import verl.hybrid_engine.weight_sync as ws\n"
        "    finish, seen = ws.PoolReceiver._finish, []\n"
        "    def _finish(self, i, *args):\n"
        "        seen.append(i)\n"
        "        if seen.count(0) == int(os.environ['KILL_AT']):\n"
        "            import time\n"
        "            open(os.environ['KILL_STAMP'], 'w').write(repr(time.time()))\n"
        "            os.kill(os.getpid(), 9)\n"
        "        return finish(self, i, *args)\n"
        "    ws.PoolReceiver._finish = _finish\n")
    env = train_env()
    env["PYTHONPATH"] = f"{hook}{os.pathsep}{env['PYTHONPATH']}"
    env["KILL_STAMP"] = str(tmp_path / "killed_at")
    env["KILL_AT"] = str(kill_at)
    env["VERL_RANK_START"] = "exec"  # each rank a fresh interpreter: the hook runs at an interpreter's start
    cmd = train_cmd("grpo_arith_tiny.yaml", tmp_path / "run", data_args, *SMALL, *POOL,
                    "hybrid_engine.bucket_bytes=16384", f"trainer.v1.trainer_mode={mode}")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    elapsed = time.time() - float((tmp_path / "killed_at").read_text())
    lines = [line for line in proc.stderr.splitlines() if line.startswith("verl train:")]
    assert proc.returncode == 137, (proc.returncode, proc.stderr[-2000:])
    assert lines == ["verl train: rank 3: killed by SIGKILL (exit 137)"], proc.stderr[-2000:]
    assert 1 in read_metrics(tmp_path / "run")  # step 1 was logged: the kill came at the sync after it
    print(f"{mode}: pool rank killed mid-transfer: the job ended {elapsed:.1f} s after the kill (bound 60 s)")
    assert elapsed < 60

