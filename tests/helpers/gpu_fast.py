"""The bookkeeping of ``bash tests/run_gpu.sh fast`` (issue 41): each stage's figures as JSON, the summary table,
and the CPU rehearsal's checks of the stages' commands (``--dry-run``).

    python -m helpers.gpu_fast record STAGE --rc N --wall-s S --timeout-s T --work DIR --out DIR [--dry-run]
    python -m helpers.gpu_fast summary --out DIR --work DIR [--budget-s S]
    python -m helpers.gpu_fast arch                      # TORCH_CUDA_ARCH_LIST of this GPU only (e.g. 9.0)
    python -m helpers.gpu_fast check-train -- ARGV       # `verl train ARGV`'s config + preflight, nothing run
    python -m helpers.gpu_fast check-quickstart -- ARGV  # `python -m launch.quickstart ARGV`'s config checks
    python -m helpers.gpu_fast check-bench-train -- ARGV # `verl bench train ARGV`: its flags and its verl train config

``record`` reads what the stage left in the work directory (bench JSONs, metrics.jsonl, the quickstart's
summary.json, pytest's junit XML) and writes ``<out>/<stage>.json``: ``stage``, ``status`` (pass / fail / timeout /
skipped), ``rc``, ``wall_s``, ``timeout_s``, ``figures`` and, where :data:`TARGETS` names one, ``targets`` (each figure
against its bound, ``met`` true/false/null). On the GPU a stage with a target not met -- missed, or its figure not
measured -- fails (``missed_targets`` names them); the CPU rehearsal (``--dry-run``) reports its stand-ins' figures
against the same bounds without enforcing them (``targets_enforced`` false): they are one H100's targets.
``summary`` gathers every stage's record into ``<out>/summary.json`` and prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import xml.etree.ElementTree as ET

STAGES = ("setup", "tests", "qwen05b", "quickstart", "bench", "pool")
TIMEOUT_CODES = (124, 137)
# Every stage's targets, in this one place (issue 41's, on one H100): stage -> name -> (comparison, bound), the
# comparison one of "at_most" (value <= bound), "at_least" (value >= bound), "above" (value > bound).
TARGETS: dict[str, dict[str, tuple[str, float]]] = {
    "qwen05b": {"s_per_step": ("at_most", 3.6)},               # the 0.5B GRPO step
    "quickstart": {"learns": ("above", 0.0)},                  # val/accuracy gain of RL over the SFT start, points
    "bench": {"copy_1mb": ("at_least", 0.7),                   # copy programs vs a device-to-device copy at 1 MB
              "copy_ge_16mb": ("at_least", 0.9),               # ... at >= 16 MB
              "reshard_over_copy": ("at_most", 2.0),           # the 0.5B local reshard vs a copy of what it receives
              "rollout_over_hf": ("at_least", 3.0)},           # native rollout tokens/s vs HF generate, 512 x 128
}


def _load(path: str):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _targets(stage: str, values: dict) -> dict:
    """Each figure in ``values`` (name -> value) against its bound in :data:`TARGETS`; ``met`` None: not measured."""
    out = {}
    for name, value in values.items():
        comparison, bound = TARGETS[stage][name]
        met = None if value is None else {"at_most": value <= bound, "at_least": value >= bound,
                                          "above": value > bound}[comparison]
        out[name] = {"value": value, comparison: bound, "met": met}
    return out


# ---- figures of each stage, from what it left in the work directory -------------------------------------

def figures_setup(work: str) -> tuple[dict, dict]:
    return _load(os.path.join(work, "setup_facts.json")), {}


def figures_tests(work: str) -> tuple[dict, dict]:
    """pytest's junit XML (a run), or the collected count (the dry run's --collect-only)."""
    xml = os.path.join(work, "tests.xml")
    if not os.path.exists(xml):  # the dry run: pytest checked the paths and options, collected nothing
        with open(os.path.join(work, "tests.log"), encoding="utf-8") as fh:
            lines = [line for line in fh.read().splitlines() if "collected" in line]
        if not lines:
            raise ValueError("tests: expected pytest's junit XML or its collection line, found neither")
        return {"collect_only": lines[-1].strip()}, {}
    cases = ET.parse(xml).getroot().iter("testcase")
    passed, failed, skipped, times = [], [], [], []
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        times.append((float(case.get("time", 0.0)), name))
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif case.find("skipped") is not None:
            skipped.append(name)
        else:
            passed.append(name)
    if not times:
        raise ValueError("tests: expected test cases in the junit XML, found none")
    slowest = [{"test": n, "s": round(t, 2)} for t, n in sorted(times, reverse=True)[:5]]
    return {"passed": len(passed), "failed": len(failed), "skipped": len(skipped), "failed_tests": failed[:20],
            "skipped_tests": skipped[:20], "slowest": slowest}, {}


def train_figures(metrics_path: str, warmup: int = 1) -> dict:
    """verl train's metrics.jsonl: s/step and the phase split (verl bench train's medians), peak GPU memory,
    update_actor tokens/s and MFU."""
    from verl.bench.train import summarize

    records = _jsonl(metrics_path)
    out = summarize(records, warmup)
    steps = [r for r in records if "timing_s/step" in r]
    measured = steps[warmup:] if len(steps) > warmup else steps

    def med(key):
        values = [r[key] for r in measured if r.get(key) is not None]
        return statistics.median(values) if values else None

    def peak(key):
        values = [r[key] for r in steps if r.get(key) is not None]
        return max(values) if values else None

    per_token = med("timing_per_token_ms/update_actor")
    out.update(first_step_s=steps[0]["timing_s/step"] if steps else None,
               peak_memory_allocated_gb=peak("perf/max_memory_allocated_gb"),
               peak_memory_reserved_gb=peak("perf/max_memory_reserved_gb"),
               peak_cpu_memory_gb=peak("perf/cpu_memory_used_gb"),
               update_actor_tokens_per_s=1000.0 / per_token if per_token else None,
               mfu_actor=med("perf/mfu/actor"), throughput_per_rank=med("perf/throughput"))
    return out


def figures_qwen05b(work: str, dry_run: bool) -> tuple[dict, dict]:
    if dry_run:
        return _load(os.path.join(work, "qwen05b_check.json")), {}
    figures = train_figures(os.path.join(work, "qwen05b", "metrics.jsonl"))
    return figures, _targets("qwen05b", {"s_per_step": figures["s_per_step"]})


QUICKSTART_KEYS = ("val_accuracy_after_sft", "val_accuracy_after_rl", "val_accuracy_gain_points", "rl_steps",
                   "tokens_per_s", "step_s", "gen_s_per_step", "update_actor_s_per_step", "reshard_s_per_step",
                   "final_score_mean", "wall_s", "wall_s_total")


def figures_quickstart(work: str, dry_run: bool) -> tuple[dict, dict]:
    if dry_run:
        return _load(os.path.join(work, "quickstart_check.json")), {}
    summary = _load(os.path.join(work, "quickstart", "summary.json"))
    figures = {k: summary.get(k) for k in QUICKSTART_KEYS}
    return figures, _targets("quickstart", {"learns": figures["val_accuracy_gain_points"]})


def kernel_figures(records: list[dict]) -> tuple[dict, dict]:
    by_size: dict[int, list[float]] = {}
    for r in records:
        by_size.setdefault(round(r["bytes"] / 2**20), []).append(r["ratio_vs_memcpy"])
    small = [v for mb, vs in by_size.items() if mb <= 1 for v in vs]
    large = [v for mb, vs in by_size.items() if mb >= 16 for v in vs]
    figures = {"device": records[0]["device"], "dtype": records[0]["dtype"], "cases": len(records),
               "ratio_vs_memcpy_by_case": {r["case"]: round(r["ratio_vs_memcpy"], 3) for r in records},
               "min_ratio_1mb": round(min(small), 3) if small else None,
               "min_ratio_ge_16mb": round(min(large), 3) if large else None}
    return figures, _targets("bench", {"copy_1mb": figures["min_ratio_1mb"],
                                       "copy_ge_16mb": figures["min_ratio_ge_16mb"]})


def figures_bench(work: str) -> tuple[dict, dict]:
    """Three benches, each optional: a missing JSON (its command failed) is reported, the others still count."""
    figures, targets, missing = {}, {}, []
    paths = {name: os.path.join(work, f"bench_{name}.json") for name in ("kernels", "reshard", "rollout")}
    if os.path.exists(paths["kernels"]):
        figures["kernels"], t = kernel_figures(_load(paths["kernels"]))
        targets.update(t)
    else:
        missing.append("kernels")
    if os.path.exists(paths["reshard"]):
        r = _load(paths["reshard"])
        figures["reshard"] = {k: r.get(k) for k in ("device", "backend", "verified", "naive_verified", "case",
                                                      "bytes_received_mean", "seconds", "memcpy_seconds",
                                                      "seconds_over_memcpy", "naive_seconds", "naive_over_seconds",
                                                      "peak_extra_bytes")}
        targets.update(_targets("bench", {"reshard_over_copy": r["seconds_over_memcpy"]}))
        if not r["verified"]:
            missing.append("reshard (not bit-exact)")
    else:
        missing.append("reshard")
    if os.path.exists(paths["rollout"]):
        r = _load(paths["rollout"])
        figures["rollout"] = {"device": r.get("device"), "batch": r["batch"], "new_tokens": r["new_tokens"],
                              "native_tokens_per_s": r["native"]["tokens_per_s"],
                              "hf_tokens_per_s": r.get("hf", {}).get("tokens_per_s"),
                              "native_over_hf": r.get("native_over_hf")}
        targets.update(_targets("bench", {"rollout_over_hf": r.get("native_over_hf")}))
    else:
        missing.append("rollout")
    if missing:
        figures["missing"] = missing
    return figures, targets


def figures_pool(work: str, dry_run: bool) -> tuple[dict, dict]:
    facts = _load(os.path.join(work, "pool_facts.json"))
    figures = {"shared_gpu": facts}
    for name in ("standalone_pool", "separate_async"):
        path = os.path.join(work, f"pool_{name}.json")
        if not os.path.exists(path):
            figures[name] = None
            continue
        r = _load(path)
        figures[name] = r if dry_run else {
            k: r.get(k) for k in ("s_per_step", "phases", "tokens_per_s", "trainer_idle_fraction",
                                  "rollout_idle_fraction", "staleness_worst_mean", "peak_rss_gb", "wall_s")}
    return figures, {}


def figures_of(stage: str, work: str, dry_run: bool) -> tuple[dict, dict]:
    if stage == "setup":
        return figures_setup(work)
    if stage == "tests":
        return figures_tests(work)
    if stage == "qwen05b":
        return figures_qwen05b(work, dry_run)
    if stage == "quickstart":
        return figures_quickstart(work, dry_run)
    if stage == "bench":
        return figures_bench(work)
    if stage == "pool":
        return figures_pool(work, dry_run)
    raise ValueError(f"stage: expected one of {', '.join(STAGES)}, found {stage!r}")


def record(stage: str, rc: int, wall_s: float, timeout_s: float, work: str, out: str, dry_run: bool,
           reason: str | None = None) -> dict:
    """``<out>/<stage>.json`` from the stage's exit code and what it left in ``work``."""
    rec: dict = {"stage": stage, "rc": rc, "wall_s": round(wall_s, 1), "timeout_s": timeout_s, "dry_run": dry_run}
    if reason is not None:  # not run (no time left)
        rec.update(status="skipped", reason=reason, figures={}, targets={})
    else:
        rec["status"] = "pass" if rc == 0 else ("timeout" if rc in TIMEOUT_CODES else "fail")
        try:
            rec["figures"], rec["targets"] = figures_of(stage, work, dry_run)
        except (OSError, ValueError, KeyError, TypeError, ET.ParseError) as err:
            rec["figures"], rec["targets"] = {}, {}
            rec["figures_error"] = f"{type(err).__name__}: {err}"
            if rec["status"] == "pass":
                rec["status"] = "fail"  # it ran, but left no figures: that is not a pass
        if rec["figures"].get("missing") and rec["status"] == "pass":
            rec["status"] = "fail"
        rec["targets_enforced"] = not dry_run
        if not dry_run:
            # A stage that ran leaves the figure of every target it has (a bench whose JSON is missing names it
            # in figures.missing and fails above); one not met, or not measured, fails the stage.
            rec["missed_targets"] = sorted(name for name, t in rec["targets"].items() if t["met"] is not True)
            if rec["missed_targets"] and rec["status"] == "pass":
                rec["status"] = "fail"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stage}.json"), "w", encoding="utf-8") as fh:
        json.dump(rec, fh, indent=1, default=str)
    return rec


def _headline(rec: dict) -> str:
    """One line of the stage's main figures for the table."""
    f, stage = rec.get("figures") or {}, rec["stage"]
    if rec.get("figures_error"):
        return rec["figures_error"][:90]
    if stage == "setup":
        return f"{f.get('gpu')} arch {f.get('arch_list')} verl._C cuda={f.get('verl_c_cuda')}"
    if stage == "tests":
        if "collect_only" in f:
            return f"options checked ({f['collect_only']})"
        return f"{f.get('passed')} passed, {f.get('failed')} failed, {f.get('skipped')} skipped"
    if stage == "qwen05b" and "s_per_step" in f:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in sorted(f["phases"].items()) if v >= 0.05)
        mem = f.get("peak_memory_allocated_gb")
        return (f"{f['s_per_step']:.2f} s/step ({phases}); peak {mem if mem is None else round(mem, 1)} GiB; "
                f"mfu {f.get('mfu_actor')}")
    if stage == "quickstart" and "val_accuracy_after_rl" in f:
        return (f"val {f['val_accuracy_after_sft']} -> {f['val_accuracy_after_rl']} in {f['rl_steps']} steps, "
                f"{f['step_s']} s/step")
    if stage == "bench":
        parts = []
        if "kernels" in f:
            parts.append(f"copy 1MB {f['kernels']['min_ratio_1mb']}, >=16MB {f['kernels']['min_ratio_ge_16mb']}")
        if "reshard" in f:
            parts.append(f"reshard/copy {f['reshard']['seconds_over_memcpy']:.2f}")
        if "rollout" in f:
            ratio = f["rollout"]["native_over_hf"]
            parts.append(f"rollout/hf {ratio:.2f}" if ratio else "rollout/hf -")
        if f.get("missing"):
            parts.append(f"missing {f['missing']}")
        return "; ".join(parts)
    if stage == "pool":
        shared = (f.get("shared_gpu") or {}).get("two_ranks_share_gpu")
        got = [n for n in ("standalone_pool", "separate_async") if f.get(n)]
        return f"two ranks share the GPU: {shared}; ran {got}"
    return rec.get("reason", "")


def summary(out: str, work: str, budget_s: float | None) -> dict:
    stages = []
    for stage in STAGES:
        path = os.path.join(out, f"{stage}.json")
        if os.path.exists(path):
            stages.append(_load(path))
    result = {"stages": stages, "passed": [s["stage"] for s in stages if s["status"] == "pass"],
              "not_passed": [s["stage"] for s in stages if s["status"] != "pass"],
              "wall_s": round(sum(s["wall_s"] for s in stages), 1), "budget_s": budget_s,
              "targets": {f"{s['stage']}.{name}": t for s in stages for name, t in (s.get("targets") or {}).items()}}
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1, default=str)
    print(f"{'stage':11s} {'status':8s} {'wall_s':>7s}  figures")
    for s in stages:
        print(f"{s['stage']:11s} {s['status']:8s} {s['wall_s']:7.1f}  {_headline(s)}")
    for name, t in result["targets"].items():
        bound = next(f"{sign} {t[key]}" for key, sign in (("at_most", "<="), ("at_least", ">="), ("above", ">"))
                     if key in t)
        value = t["value"] if not isinstance(t["value"], float) else round(t["value"], 3)
        print(f"target {name}: {value} (want {bound}) met={t['met']}")
    print(f"total {result['wall_s']} s (budget {budget_s} s); not passed: {result['not_passed'] or 'none'}")
    return result


# ---- the dry run's checks: every command's flags and configs, nothing trained ------------------------------

def check_train(argv: list[str]) -> dict:
    """What ``verl train ARGV`` checks before any rank starts: its flags, the config with every override, and
    the preflight (model, data, tokenizer)."""
    import verl.trainer.main_ppo as main_ppo
    from verl.trainer.config import load_config
    from verl.trainer.config.loader import config_dir_from_cli
    from verl.trainer.config.sections import PPOSections
    from verl.trainer.preflight import preflight

    args = main_ppo.build_parser().parse_args(argv)
    config = load_config(args.config, args.overrides, config_name=args.config_name,
                         config_dir=config_dir_from_cli(args.config_path, main_ppo.__file__))
    preflight(PPOSections.from_tree(config, ""))
    from verl.trainer.config import job_size

    return {"checked": "verl train", "config": args.config or args.config_name, "overrides": len(args.overrides),
            "total_training_steps": int(config.trainer.total_training_steps), "ranks": int(job_size(config))}


def check_quickstart(argv: list[str]) -> dict:
    """``launch.quickstart``'s flags and both stages' configs, as its main() checks them before the first stage."""
    import launch.quickstart as qs

    args = qs._parser().parse_args(argv)
    out = os.path.abspath(args.out or qs.default_out(args.config))
    data_dir, sft_dir = os.path.join(out, "data"), os.path.join(out, "sft")
    rl_config, sft_config = os.path.join(qs.REPO, args.config), os.path.join(qs.REPO, args.sft_config)
    architecture = qs.rl_architecture(rl_config)
    sft_overrides = [f"data.train_files={data_dir}/train.parquet", f"data.val_files={data_dir}/test.parquet",
                     f"model.tokenizer_path={data_dir}/tokenizer", f"trainer.output_dir={sft_dir}",
                     *([f"model.path={architecture}"] if architecture else []), *args.sft_override]
    rl = qs.check_configs(sft_config, sft_overrides, rl_config, data_dir, out, args.overrides)
    from verl.trainer.config import job_size

    return {"checked": "quickstart", "rl_steps": int(rl.trainer.total_training_steps), "ranks": int(job_size(rl))}


def check_bench_train(argv: list[str], work: str) -> dict:
    """``verl bench train ARGV``: its flags, and the verl train command it would run, checked as above."""
    from verl.bench.train import build_parser, train_command, write_bench_data

    args = build_parser().parse_args(argv)
    data_dir = os.path.join(work, "bench_train_data")
    prompt_length = write_bench_data(data_dir, args.prompts)  # the arithmetic task: the pool stage's model is a config
    command = train_command(args, data_dir, os.path.join(work, "bench_train_out"), prompt_length)
    module = command.index("verl.trainer.main_ppo")
    checked = check_train(command[module + 1:])
    return {**checked, "checked": "verl bench train", "mode": args.mode, "nproc": args.nproc}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m helpers.gpu_fast", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("stage", choices=STAGES)
    r.add_argument("--rc", type=int, required=True)
    r.add_argument("--wall-s", type=float, required=True)
    r.add_argument("--timeout-s", type=float, required=True)
    r.add_argument("--work", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--dry-run", action="store_true")
    r.add_argument("--skipped", metavar="REASON", help="the stage did not run: why")
    s = sub.add_parser("summary")
    s.add_argument("--out", required=True)
    s.add_argument("--work", required=True)
    s.add_argument("--budget-s", type=float)
    sub.add_parser("arch")
    for name in ("check-train", "check-quickstart", "check-bench-train"):
        c = sub.add_parser(name)
        c.add_argument("--json", action="append", default=[],
                       help="also write the result here (check-bench-train: one per ':::'-separated command)")
        c.add_argument("--work", default="/tmp")
        c.add_argument("argv", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.cmd == "record":
        rec = record(args.stage, args.rc, args.wall_s, args.timeout_s, args.work, args.out, args.dry_run,
                     args.skipped)
        print(f"[{args.stage}] {rec['status']} in {rec['wall_s']} s: {_headline(rec)}")
        return 0
    if args.cmd == "summary":
        summary(args.out, args.work, args.budget_s)
        return 0
    if args.cmd == "arch":
        import torch

        if not torch.cuda.is_available():
            print("run_gpu: expected a CUDA device for the arch list, found none", file=sys.stderr)
            return 2
        major, minor = torch.cuda.get_device_capability(0)
        print(f"{major}.{minor}")
        return 0
    from verl.errors import InputError

    rest = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    commands: list[list[str]] = [[]]
    for item in rest:  # several commands in one process (the imports are most of a check's cost)
        if item == ":::" and args.cmd == "check-bench-train":
            commands.append([])
        else:
            commands[-1].append(item)
    if args.json and len(args.json) != len(commands):
        print(f"{args.cmd}: expected one --json per command, found {len(args.json)} for {len(commands)}",
              file=sys.stderr)
        return 2
    for i, command in enumerate(commands):
        try:
            if args.cmd == "check-train":
                result = check_train(command)
            elif args.cmd == "check-quickstart":
                result = check_quickstart(command)
            else:
                result = check_bench_train(command, args.work)
        except InputError as err:  # ConfigError, PreflightError, ...: what verl train would print, one line
            print(f"{args.cmd}: {err}", file=sys.stderr)
            return 2
        print(json.dumps(result))
        if args.json:
            with open(args.json[i], "w", encoding="utf-8") as fh:
                json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
