"""`verl check-env`: what this machine has for verl-hpc, one line per component.

    [✓] present and usable    [!] present but degraded / optional and absent    [✗] missing

Every [✗] line ends with the exact command that fixes it. The exit code is 0 when every
*required* component is present (what the CPU quickstart needs), 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import TextIO

from verl.errors import EXIT_INTERNAL_ERROR

OK, WARN, FAIL = "✓", "!", "✗"


@dataclasses.dataclass
class Check:
    status: str  # OK, WARN or FAIL
    name: str
    detail: str
    fix: str | None = None  # the exact command, for FAIL lines
    required: bool = False

    def line(self) -> str:
        text = f"[{self.status}] {self.name:<16} {self.detail}"
        if self.fix and self.status != OK:
            text += f"  ->  fix: {self.fix}"
        return text


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:  # any import failure means "not usable"
        return None
    return str(getattr(mod, "__version__", "unknown version"))


def check_python() -> Check:
    v = sys.version_info
    ok = v >= (3, 10)
    return Check(OK if ok else FAIL, "python", f"{v.major}.{v.minor}.{v.micro} ({sys.executable})",
                 fix="install Python >= 3.10 (e.g. `pyenv install 3.11`)", required=True)


def check_torch() -> Check:
    version = _version("torch")
    if version is None:
        return Check(FAIL, "torch", "not importable", fix="pip install torch==2.13.0", required=True)
    import torch

    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    return Check(OK, "torch", f"{version} ({cuda})", required=True)


def check_megatron() -> Check:
    try:
        with warnings.catch_warnings():  # "TE/apex not installed" warnings: apex has its own line
            warnings.simplefilter("ignore")
            from megatron.core import package_info

        version = package_info.__version__
    except Exception:
        return Check(FAIL, "megatron-core", "not importable", fix='pip install "megatron-core>=0.16.1"', required=True)
    return Check(OK, "megatron-core", version, required=True)


def check_extension() -> list[Check]:
    fix = "pip install --no-build-isolation -e .   (in the verl-hpc repository root)"
    try:
        import verl._C as _C
    except Exception as exc:
        return [Check(FAIL, "verl._C (cpu)", f"compiled extension not importable ({type(exc).__name__})", fix=fix,
                      required=True)]
    checks = [Check(OK, "verl._C (cpu)", f"copy-program op present, {_C.cpu_num_threads()} OpenMP threads",
                    required=True)]
    from verl.utils.device import visible_gpu_count

    if _C.built_with_cuda():
        checks.append(Check(OK, "verl._C (cuda)", "CUDA copy-program op present"))
    elif visible_gpu_count():
        checks.append(Check(FAIL, "verl._C (cuda)", "a GPU is visible but the extension was built without CUDA",
                            fix="VERL_BUILD_CUDA=1 pip install --no-build-isolation -e .", required=True))
    else:
        checks.append(Check(WARN, "verl._C (cuda)", "not built (CPU-only torch); the CPU executor is used"))
    return checks


def check_mpi() -> Check:
    try:
        import mpi4py

        # Load the MPI library without MPI_Init: initialising outside a launcher can abort.
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        library = MPI.Get_library_version().strip().splitlines()[0]
    except ImportError:
        return Check(FAIL, "mpi4py", "not importable", fix="pip install mpi4py")
    except Exception as exc:  # mpi4py present, MPI library missing or broken
        return Check(FAIL, "mpi4py", f"MPI library not loadable ({exc})",
                     fix="apt-get install -y openmpi-bin libopenmpi-dev")
    return Check(OK, "mpi4py", f"{_version('mpi4py')} on {library}")


def check_slurm() -> Check:
    commands = ("sbatch", "srun", "squeue", "scancel")
    missing = [c for c in commands if shutil.which(c) is None]
    if missing:
        return Check(FAIL, "slurm", f"client commands not on PATH: {', '.join(missing)}",
                     fix="apt-get install -y slurm-client   (a local test cluster: bash slurm/local/start.sh)")
    try:
        out = subprocess.run(["sbatch", "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = "version unknown"
    return Check(OK, "slurm", out or "version unknown")


def check_engine_env(package: str) -> Check:
    """A rollout engine that lives in its own environment (verl.utils.engine_env): here, in its venv, or absent."""
    from verl.utils.engine_env import ENGINE_ENVS, importable

    env = ENGINE_ENVS[package]
    if importable(package):
        return Check(OK, package, _version(package) or "installed, import failed")
    if os.path.isfile(env.python):
        return Check(OK, package, f"in {os.path.dirname(os.path.dirname(env.python))} (rollout.name={package} runs "
                                  "under its bin/verl)")
    return Check(WARN, package, "not installed (optional; the native rollout engine is used)",
                 fix=f"bash {env.setup}   (CPU route, {env.venv}; GPU nodes: {env.name}'s own install)")


def check_sglang() -> Check:
    return check_engine_env("sglang")


def check_vllm() -> Check:
    return check_engine_env("vllm")


def check_apex() -> Check:
    try:
        importlib.import_module("apex.normalization")
    except Exception:
        return Check(WARN, "apex", "not installed (optional accelerator; never install PyPI's unrelated `apex`)",
                     fix="pip install -v --no-build-isolation git+https://github.com/NVIDIA/apex   (GPU nodes)")
    return Check(OK, "apex", "NVIDIA apex fused kernels available")


def check_nvcc() -> Check:
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        return Check(FAIL, "nvcc", "not found (CUDA sources cannot be compiled)",
                     fix="apt-get install -y nvidia-cuda-toolkit")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
        release = [line for line in out.splitlines() if "release" in line]
        detail = release[0].strip() if release else nvcc
    except (OSError, subprocess.TimeoutExpired):
        detail = nvcc
    return Check(OK, "nvcc", detail)


def check_gpus() -> Check:
    try:
        from verl.utils.device import visible_gpu_count

        count = visible_gpu_count()
    except Exception:
        count = 0
    if count == 0:
        return Check(WARN, "gpus", "none visible: training and rollout run on CPU (gloo)")
    import torch

    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    return Check(OK, "gpus", f"{count} x {', '.join(names)}")


CHECKS: list[Callable[[], object]] = [
    check_python, check_torch, check_megatron, check_extension, check_mpi, check_slurm,
    check_sglang, check_vllm, check_apex, check_nvcc, check_gpus,
]


def run_checks() -> list[Check]:
    results: list[Check] = []
    for fn in CHECKS:
        out = fn()
        results.extend(out if isinstance(out, list) else [out])
    return results


def check_env(stream: TextIO | None = None) -> int:
    """Print one line per component; return 0 when every required component is present."""
    stream = stream or sys.stdout
    results = run_checks()
    for check in results:
        print(check.line(), file=stream)
    missing = [c.name for c in results if c.required and c.status == FAIL]
    if missing:
        print(f"verl check-env: required components missing: {', '.join(missing)}", file=stream)
        return EXIT_INTERNAL_ERROR
    return 0


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="verl check-env", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    return check_env()
