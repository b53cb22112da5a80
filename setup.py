"""Builds the verl package and its compiled extension verl._C.

The extension is C++/OpenMP everywhere; the CUDA executor (csrc/reshard/reshard_cuda.cu) is added
when the installed torch has CUDA and nvcc is found. CMakeLists.txt builds the same sources
standalone (C++ tests, nvcc compile checks) without torch.
"""

import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")
CPU_SOURCES = [
    os.path.join(CSRC, "bindings.cpp"),
    os.path.join(CSRC, "reshard", "validate.cpp"),
    os.path.join(CSRC, "reshard", "reshard_cpu.cpp"),
]
CUDA_SOURCES = [os.path.join(CSRC, "reshard", "reshard_cuda.cu")]


def _use_cuda() -> bool:
    import torch

    if os.environ.get("VERL_BUILD_CUDA", "auto") == "0":
        return False
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def _extension():
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp"]
    include_dirs = [os.path.join(ROOT, CSRC)]
    if _use_cuda():
        return cpp_extension.CUDAExtension(
            "verl._C",
            CPU_SOURCES + CUDA_SOURCES,
            include_dirs=include_dirs,
            define_macros=[("VERL_WITH_CUDA", None)],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "-std=c++17", "-gencode", "arch=compute_80,code=sm_80",
                         "-gencode", "arch=compute_90,code=sm_90"],
            },
            extra_link_args=["-fopenmp"],
        )
    return cpp_extension.CppExtension(
        "verl._C",
        CPU_SOURCES,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp"],
    )


def _version() -> str:
    with open(os.path.join(ROOT, "verl", "__init__.py"), encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("__version__"):
                return line.split("=")[1].strip().strip('"')
    raise RuntimeError("verl/__init__.py has no __version__")


setup(
    name="verl-hpc",
    version=_version(),
    description="HybridFlow (verl) RL post-training on Megatron-core, SGLang and Slurm, with an in-place compiled 3D-HybridEngine",
    python_requires=">=3.10",
    packages=find_packages(include=["verl", "verl.*", "launch", "launch.*"]),
    include_package_data=True,
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1",
        "numpy",
        "pybind11",
        "ninja",
        "mpi4py",
        "safetensors",
        "transformers",
        "tokenizers",
        "pyarrow",
        "pandas",
        "omegaconf",
        "pyyaml",
        "tensorboard",
        "tqdm",
        "rich",
        "matplotlib",
        "psutil",
    ],
    extras_require={
        # The CPU path of this project's machines and CI: the local CPU wheel of torch.
        "cpu": ["torch==2.13.0"],
        "test": ["pytest", "pytest-benchmark", "hypothesis", "scipy"],
        # SGLang is installed by tests/sglang/install_sglang_cpu.sh (--no-deps route on CPU);
        # on GPU clusters install `sglang` from its own instructions.
    },
    entry_points={"console_scripts": ["verl=verl.cli:main"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
