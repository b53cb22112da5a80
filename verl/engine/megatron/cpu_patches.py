"""Patches that let megatron-core 0.16.1 run on a CPU-only torch build (gloo).

megatron-core hard-codes CUDA in a handful of places, listed below.
Each patch targets one of them, is named, can be reverted (tests prove it is needed by
reverting it), and is applied by :func:`apply_cpu_patches` only when CUDA is absent: GPU runs never
go through this module. Everything else (fusions off, CPU initialisation, fp32) is a config flag,
set where the model is built.

Patches, narrowest first:
  rng_tracker          the model-parallel RNG tracker keeps CPU-generator states
  current_device       torch.cuda.current_device() -> the CPU device (buffer allocation)
  synchronize          torch.cuda.synchronize() -> no-op (pipeline p2p)
  cuda_literals        device="cuda" factories in the megatron modules that hard-code them -> CPU
  tensor_cuda          Tensor.cuda() -> identity (tied embeddings across pipeline stages)
  optimizer_type_check megatron.core.optimizer sees fp32 CPU tensors as 'torch.cuda.FloatTensor'
  sp_torch_norm        sequence parallel with torch norms (tag the norm params .sequence_parallel)
The last four only change calls that would otherwise raise on a CPU build, or (type check) only
for callers inside megatron's optimizer package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterator

import torch

from verl.utils.device import is_cuda_available

# megatron modules that create tensors with a literal device="cuda" on the training path.
CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens
    "megatron.core.optimizer.clip_grads",  # norm buffers, dummy overflow buffer
    "megatron.core.optimizer.optimizer",  # found_inf, _scale_one, constant loss scale
    "megatron.core.optimizer.grad_scaler",  # loss-scale tensors
    "megatron.core.transformer.utils",  # default causal mask
    "megatron.core.utils",  # local_multi_tensor_l2_norm (grad norm without apex / TE)
)
_TORCH_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn")


@dataclasses.dataclass
class CpuPatch:
    name: str
    why: str
    install: Callable[[], Callable[[], None]]  # installs the patch, returns its undo
    undo: Callable[[], None] | None = None

    @property
    def applied(self) -> bool:
        return self.undo is not None


def _set_attr(owner, attr: str, value) -> Callable[[], None]:
    """Set ``owner.attr``; the undo restores the owner's own entry (or the inherited one)."""
    had_own, old = attr in vars(owner), vars(owner).get(attr)
    setattr(owner, attr, value)

    def undo():
        if had_own:
            setattr(owner, attr, old)
        else:
            delattr(owner, attr)
    return undo


def _chain(undos: list[Callable[[], None]]) -> Callable[[], None]:
    def undo():
        for fn in reversed(undos):
            fn()
    return undo


def _install_rng_tracker():
    import megatron.core.tensor_parallel.random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(tracker, name, seed):
        # Same bookkeeping as CudaRNGStatesTracker.add, on the CPU generator: the original reads
        # torch.cuda.get_rng_state() (raises) after torch.cuda.manual_seed() (a silent no-op).
        tracker._is_initialized = True
        if seed in tracker.seeds_:
            raise ValueError(f"rng tracker: seed {seed} already exists")
        if name in tracker.states_:
            raise ValueError(f"rng tracker: state {name!r} already exists")
        tracker.seeds_.add(seed)
        generator = torch.Generator().manual_seed(seed)
        tracker.states_[name] = generator.get_state()

    return _chain([
        _set_attr(mrandom, "_get_cuda_rng_state", get_state),
        _set_attr(mrandom, "_set_cuda_rng_state", set_state),
        _set_attr(mrandom.CudaRNGStatesTracker, "add", add),
    ])


def _install_current_device():
    return _set_attr(torch.cuda, "current_device", lambda: torch.device("cpu"))


def _install_synchronize():
    return _set_attr(torch.cuda, "synchronize", lambda device=None: None)


class _CpuDeviceTorch:
    """Stands in for ``torch`` inside one megatron module: factories map device "cuda" to CPU."""

    def __init__(self):
        self._wrapped = {}

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in _TORCH_FACTORIES:
            return attr
        if name not in self._wrapped:
            def factory(*args, _fn=attr, **kwargs):
                device = kwargs.get("device")
                if device is not None and torch.device(device).type == "cuda":
                    kwargs["device"] = "cpu"
                return _fn(*args, **kwargs)
            self._wrapped[name] = factory
        return self._wrapped[name]


def _install_cuda_literals():
    proxy = _CpuDeviceTorch()
    return _chain([_set_attr(importlib.import_module(m), "torch", proxy) for m in CUDA_LITERAL_MODULES])


def _install_tensor_cuda():
    return _set_attr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


def _install_optimizer_type_check():
    original = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        # megatron's optimizers accept only 'torch.cuda.*Tensor' params and grads.
        if not args and not kwargs and caller.startswith("megatron.core.optimizer") \
                and result.startswith("torch.") and not result.startswith("torch.cuda."):
            return "torch.cuda." + result[len("torch."):]
        return result

    return _set_attr(torch.Tensor, "type", tensor_type)


def _install_sp_torch_norm():
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
            zero_centered_gamma=False, normalization="LayerNorm"):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, persist_layer_norm,
                                zero_centered_gamma, normalization)
        # A torch norm is per-token, so it is correct on a sequence shard; its grads are partial
        # sums over the shard, which finalize_model_grads all-reduces over TP for tagged params.
        norm = original_new(cls, dataclasses.replace(config, sequence_parallel=False), hidden_size,
                            eps, persist_layer_norm, zero_centered_gamma, normalization)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return _set_attr(torch_norm.WrappedTorchNorm, "__new__", staticmethod(new))


PATCHES: dict[str, CpuPatch] = {p.name: p for p in (
    CpuPatch("rng_tracker", "CudaRNGStatesTracker reads torch.cuda RNG state (random.py add/fork)",
             _install_rng_tracker),
    CpuPatch("current_device", "buffers allocated on torch.cuda.current_device()", _install_current_device),
    CpuPatch("synchronize", "torch.cuda.synchronize() in pipeline p2p communication", _install_synchronize),
    CpuPatch("cuda_literals", "device='cuda' tensor factories in " + ", ".join(CUDA_LITERAL_MODULES),
             _install_cuda_literals),
    CpuPatch("tensor_cuda", "weight.data.cuda() for tied embeddings with PP>1 (language_module.py)",
             _install_tensor_cuda),
    CpuPatch("optimizer_type_check", "asserts param.type() == 'torch.cuda.FloatTensor' "
             "(clip_grads.py, distrib_optimizer.py)", _install_optimizer_type_check),
    CpuPatch("sp_torch_norm", "WrappedTorchNorm asserts 'sequence parallel not supported'",
             _install_sp_torch_norm),
)}


def cpu_patches_needed() -> bool:
    return not is_cuda_available()


def apply_cpu_patches(names: list[str] | None = None) -> list[str]:
    """Apply the named patches (all by default) when CUDA is absent; idempotent.

    Returns the names of the patches now in effect (empty on a CUDA machine).
    """
    if not cpu_patches_needed():
        return []
    for name in names if names is not None else list(PATCHES):
        if name not in PATCHES:
            raise KeyError(f"megatron cpu patch: expected one of {sorted(PATCHES)}, found {name!r}")
        patch = PATCHES[name]
        if not patch.applied:
            patch.undo = patch.install()
    return applied_cpu_patches()


def applied_cpu_patches() -> list[str]:
    return [name for name, patch in PATCHES.items() if patch.applied]


def revert_cpu_patch(name: str) -> None:
    patch = PATCHES[name]
    if patch.applied:
        patch.undo()
        patch.undo = None


@contextlib.contextmanager
def cpu_patch_reverted(name: str) -> Iterator[None]:
    """Run a block without one patch (tests use it to show the patch is needed)."""
    was_applied = PATCHES[name].applied
    revert_cpu_patch(name)
    try:
        yield
    finally:
        if was_applied:
            apply_cpu_patches([name])
