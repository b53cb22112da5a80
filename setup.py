"""Builds the verl package and its compiled extension verl._C.

The extension is C++/OpenMP everywhere; the CUDA executor (csrc/reshard/reshard_cuda.cu) is added
when the installed torch has CUDA and nvcc is found. CMakeLists.txt builds the same sources
standalone (C++ tests, nvcc compile checks) without torch.
"""

import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
DEFAULT_CUDA_ARCHS = ("8.0", "9.0")  # A100, H100


def _kernel_sources() -> list:
    """csrc/sources.txt: the kernel sources shared with CMakeLists.txt."""
    with open(os.path.join(ROOT, CSRC, "sources.txt"), encoding="utf-8") as fh:
        return [line.strip() for line in fh if line.strip() and not line.startswith("#")]


CPU_SOURCES = [os.path.join(CSRC, "bindings.cpp")] + [s for s in _kernel_sources() if not s.endswith(".cu")]
CUDA_SOURCES = [s for s in _kernel_sources() if s.endswith(".cu")]


def _cuda_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST when set (torch's own convention); else the local GPU's arch plus sm_80 and
    sm_90, so one build serves this node and the common cluster GPUs."""
    import torch

    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    archs = list(DEFAULT_CUDA_ARCHS)
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        archs.append(f"{major}.{minor}")
    return ";".join(sorted(set(archs), key=float))


def _use_cuda() -> bool:
    import torch

    if os.environ.get("VERL_BUILD_CUDA", "auto") == "0":
        return False
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def _torch_rpath() -> list:
    """The loader finds libc10.so / libtorch*.so next to torch (an rpath), so `import verl._C` needs no
    `import torch` first and no LD_LIBRARY_PATH."""
    return [f"-Wl,-rpath,{lib}" for lib in cpp_extension.library_paths()]


def _extension():
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp"]
    include_dirs = [os.path.join(ROOT, CSRC)]
    if _use_cuda():
        # torch's build reads TORCH_CUDA_ARCH_LIST to choose the -gencode flags.
        os.environ["TORCH_CUDA_ARCH_LIST"] = _cuda_arch_list()
        return cpp_extension.CUDAExtension(
            "verl._C",
            CPU_SOURCES + CUDA_SOURCES,
            include_dirs=include_dirs,
            define_macros=[("VERL_WITH_CUDA", None)],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "-std=c++17"],
            },
            extra_link_args=["-fopenmp", *_torch_rpath()],
        )
    return cpp_extension.CppExtension(
        "verl._C",
        CPU_SOURCES,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp", *_torch_rpath()],
    )


def _requirements(name: str) -> list:
    with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
        return [line.split("#")[0].strip() for line in fh if line.split("#")[0].strip()]


def _version() -> str:
    with open(os.path.join(ROOT, "verl", "version.py"), encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("__version__"):
                return line.split("=")[1].strip().strip('"')
    raise RuntimeError("verl/version.py has no __version__")


setup(
    name="verl-hpc",
    version=_version(),
    description=("HybridFlow (verl) RL post-training on Megatron-core, SGLang and Slurm, with an in-place compiled "
                 "3D-HybridEngine"),
    python_requires=">=3.10",
    packages=find_packages(include=["verl", "verl.*", "launch", "launch.*"]),
    include_package_data=True,
    package_data={"verl.trainer.config": ["*.yaml"]},  # the packaged defaults (--config-path=config)
    install_requires=_requirements("requirements.txt"),
    extras_require={
        # The CPU path of this project's machines and CI: the local CPU wheel of torch.
        "cpu": ["torch==2.13.0"],
        "test": _requirements("requirements-test.txt"),
        # SGLang is installed by launch/setup_sglang.sh (--no-deps route on CPU);
        # on GPU clusters install `sglang` from its own instructions.
    },
    entry_points={"console_scripts": ["verl=verl.cli:console_main"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
