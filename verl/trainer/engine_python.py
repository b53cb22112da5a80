"""A generation command run again under the python of the environment its engine lives in (SGLang's, vLLM's:
:data:`verl.utils.engine_env.ENGINE_ENVS`), when this python cannot import the engine; shared by `verl generate`
(:mod:`verl.trainer.main_generation`) and verl's generation job (:mod:`verl.trainer.generation_job`)."""

from __future__ import annotations

import os
import subprocess
import sys

# Set in the command re-run under an engine environment's python: that python must import the engine itself.
IN_ENGINE_ENV = "VERL_GENERATE_IN_ENGINE_ENV"


def rerun_under_engine_python(package: str, argv: list[str], what: str, error: type[Exception]) -> int:
    """``python -m verl.trainer.main_generation ARGV`` again under the python of ``package``'s environment (this one
    cannot import it); ``error(...)`` names ``what`` when that python is missing or is this one."""
    from verl.launcher.spawn import child_preexec
    from verl.utils.engine_env import ENGINE_ENVS, REPO

    env_spec = ENGINE_ENVS[package]
    python = env_spec.python
    if os.environ.get(IN_ENGINE_ENV):
        raise error(f"{what}: expected {package} importable in {sys.executable}, found it is not")
    if not os.path.isfile(python):
        raise error(f"{what}: {package} is not importable here and {python} does not exist; "
                    f"run {env_spec.setup} or set {env_spec.python_var}")
    env = dict(os.environ)
    env[IN_ENGINE_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return subprocess.run([python, "-m", "verl.trainer.main_generation", *argv], env=env,
                          preexec_fn=child_preexec()).returncode
