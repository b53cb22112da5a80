"""Running `verl train` as a subprocess from the end-to-end tests, and what they check in its metrics."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

psutil = pytest.importorskip("psutil")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT_S = 240


def train_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=REPO, VERL_STRICT_DATA_CHECK="1", OMP_NUM_THREADS="1")
    return env


def read_metrics(output_dir):
    from verl.utils.tracking import read_metrics as read

    return {record["step"]: record for record in read(str(output_dir))}


def kill_tree(pid):
    """SIGKILL the launcher and every rank it started (ranks run in their own sessions)."""
    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def run_until_step_then_kill(cmd, output_dir, step):
    """Start ``cmd`` (a `verl train` writing to ``output_dir``) and SIGKILL it and all its ranks as soon as
    step ``step`` is logged, so every checkpoint saved before that step is complete and later steps are
    not logged; fails if the run ends first."""
    launcher = subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and launcher.poll() is None:
            if (output_dir / "metrics.jsonl").is_file() and step in read_metrics(output_dir):
                break
            time.sleep(0.05)
        assert launcher.poll() is None, f"the run finished before it could be killed after step {step}"
    finally:
        kill_tree(launcher.pid)


COMMON_KEYS = [
    "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "actor/pg_loss", "actor/entropy",
    "actor/ppo_kl", "actor/pg_clipfrac", "response_length/mean", "timing_s/gen", "timing_s/ref", "timing_s/adv",
    "timing_s/update_actor", "timing_s/update_weights", "timing_s/step", "perf/throughput", "perf/reshard_bytes",
    "perf/cpu_memory_used_gb", "training/global_step", "training/epoch",
]
CRITIC_KEYS = ["critic/vf_loss", "critic/values/mean", "critic/vf_explained_var", "timing_s/values",
               "timing_s/update_critic"]
# What a CPU run must not log: the per-rank memory series and max/min pairs verl does not have, the
# reshard nested in gen under its own name, and an MFU without a promised peak.
GONE_KEYS = ("perf/rss_mb", "timing_s/reshard", "perf/cpu_memory_used_gb/", "perf/mfu/")
# The phases of one step (trainer.train_step), each timed once, that make up timing_s/step.
STEP_PHASES = ("swap_reward_model", "update_weights", "gen", "gen_max", "reward", "old_log_prob", "ref", "values",
               "adv", "update_critic", "update_actor")
VAL_KEYS = ["val/accuracy", "val-core/arithmetic/reward/mean@1"]
# Wall-clock and memory readings differ between any two runs; everything else must match exactly.
NONDETERMINISTIC_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/throughput", "perf/time_per_step",
                             "perf/cpu_memory_used_gb", "perf/max_memory", "perf/mfu/", "perf/time_to_first_step")


def train_cmd(config, output_dir, data_args, *overrides):
    return [sys.executable, "-m", "verl.cli", "train", "--config", os.path.join(REPO, "configs", config),
            *data_args, f"trainer.output_dir={output_dir}", "trainer.logger=[console,csv]", *overrides]


def run_train(cmd, env=None):
    """``cmd`` to completion (exit 0 asserted); ``env``: variables added to the run's environment."""
    proc = subprocess.run(cmd, cwd=REPO, env={**train_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"verl train exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def check_step_record(record, step, keys):
    """``keys`` present, verl's step counters, no retired names, and the phases fitting inside the step."""
    missing = [k for k in keys if k not in record]
    assert not missing, f"step {step} lacks {missing}"
    # 64 training prompts in batches of 64 (the configs' train_batch_size): one step per epoch.
    assert (record["training/global_step"], record["training/epoch"]) == (step, step - 1)
    gone = [k for k in record if k.startswith(GONE_KEYS)]
    assert not gone, f"step {step} logs {gone}"
    phases = sum(record.get(f"timing_s/{p}", 0.0) for p in STEP_PHASES)
    # The phases are disjoint intervals inside the step; what lies outside them (building the prompt batch,
    # reading the rollout's metrics) depends on the machine's load, so it is not bounded here.
    assert 0 < phases <= record["timing_s/step"] + 1e-6, (
        f"step {step}: phases {phases:.3f}s vs timing_s/step {record['timing_s/step']:.3f}s")


def deterministic(record):
    return {k: v for k, v in record.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)}


def save_arith_reward_model(path, zero_head=False):
    """A tiny random Qwen2 reward model over the arithmetic tokenizer's 32 ids (TP=2 divides it)."""
    import torch
    import transformers

    config = transformers.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      num_labels=1, pad_token_id=0, initializer_range=0.5)
    torch.manual_seed(0)
    model = transformers.Qwen2ForSequenceClassification(config)
    if zero_head:
        with torch.no_grad():
            model.score.weight.zero_()
    model.save_pretrained(path)


# ---------------------------------------------------------------------------- the data plane vs the legacy path
EPS32 = 2.0**-24  # float32's unit roundoff
# Keys the controller reduces over a batch's tokens: the legacy path in float32 over the whole tensor, the data
# plane in float64 from per-row sums. Their difference is bounded by the float32 reduction's error,
# tokens * EPS32 * (largest magnitude summed); the largest magnitude comes from the metric's own max/min keys
# (or the value itself where there are none).
REDUCED = {"actor/entropy": None, "critic/advantages/mean": "critic/advantages",
           "critic/returns/mean": "critic/returns", "critic/values/mean": "critic/values",
           "critic/rewards/mean": "critic/rewards", "critic/score/mean": "critic/score",
           "training/rollout_probs_diff_mean": "training/rollout_probs_diff",
           "training/rollout_probs_diff_std": "training/rollout_probs_diff",
           "critic/vf_explained_var": None, "actor/reward_kl_penalty": None}
DATA_PLANE_KEYS = ("perf/data_plane_received_mb", "perf/data_plane_object_mb", "perf/data_plane_shard_mb",
                   "perf/data_plane_seconds", "perf/data_plane_peak_rss_mb")


def _data_plane_bound(record, key):
    tokens = record["perf/total_num_tokens"]
    prefix = REDUCED[key]
    scale = max(abs(record[f"{prefix}/max"]), abs(record[f"{prefix}/min"])) if prefix and \
        f"{prefix}/max" in record else abs(record[key])
    if key == "critic/vf_explained_var":  # 1 - a ratio of two variances, each with the reduction's error
        scale = 2 * max(1.0, abs(1.0 - record[key]))
    return 4 * tokens * EPS32 * scale


def assert_same_run_on_both_paths(legacy, sharded):
    """Two runs' metrics per step, the legacy path's and the data plane's: equal, but for the data plane's own
    figures, and the token reductions (within their summation-order bound)."""
    assert sorted(legacy) == sorted(sharded)
    for step in legacy:
        a, b = legacy[step], sharded[step]
        # The data plane's own figures (the legacy path logs them too under VERL_DATA_PLANE_STATS=1).
        assert (set(b) ^ set(a)) <= set(DATA_PLANE_KEYS), (step, set(b) ^ set(a))
        if step:
            assert b["perf/data_plane_object_mb"] > 0
        for key in a:
            if key.startswith(NONDETERMINISTIC_PREFIXES) or key in DATA_PLANE_KEYS:
                continue
            if key in REDUCED:
                bound = _data_plane_bound(a, key)
                assert abs(a[key] - b[key]) <= bound, (step, key, a[key], b[key], bound)
            else:
                assert a[key] == b[key], (step, key, a[key], b[key])


def ledger(output_dir):
    """The asynchronous trainers' prompt ledger (``prompt_ledger.jsonl``), one record per step."""
    with open(output_dir / "prompt_ledger.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def check_accounting(lines, steps, batch=16):
    """One ledger line per step 1..steps; each step trains a batch; no prompt trained twice in an epoch; every
    prompt drawn is trained, evicted, in flight or finished."""
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    trained = [uid for line in lines for uid in line["trained"]]
    assert all(len(line["trained"]) == batch for line in lines)
    assert len(trained) == len(set(trained)), "a prompt was trained twice in one epoch"
    last = lines[-1]
    assert last["trained_total"] == steps * batch
    assert last["drawn"] == last["trained_total"] + last["evicted_total"] + last["in_flight"] + last["finished"]
    return trained
