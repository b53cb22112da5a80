"""`verl generate` as a user of the project venv runs it: a subprocess of this python, which re-runs itself under an
engine's own venv python (named by ``python_var``) when the engine lives there; the native engine beside it."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[5, 17, 42, 99, 7], [250, 3, 3, 18, 77, 120, 64, 9, 31], [40]]


def verl_generate(engine, model_dir, out, *extra, python_var=None, python=None, threads=1, timeout=300):
    cmd = [sys.executable, "-m", "verl.trainer.main_generation", "--engine", engine, "--model", model_dir,
           "--json", str(out), *extra]
    for prompt in PROMPTS:
        cmd += ["--input-ids", ",".join(map(str, prompt))]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=str(threads))
    if python_var and python:
        env[python_var] = python
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def engine_vs_native(engine, model_dir, tmp_path, common, python_var, python, threads=1) -> dict:
    """Each engine's JSON output for the same command; asserts both exit 0."""
    results = {}
    for name in ("native", engine):
        proc = verl_generate(name, model_dir, tmp_path / f"{name}.json", *common, python_var=python_var,
                             python=python, threads=threads)
        assert proc.returncode == 0, f"verl generate --engine {name} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    return results


def max_logprob_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for ra, rb in zip(a["logprobs"], b["logprobs"], strict=True)
               for x, y in zip(ra, rb, strict=True))
