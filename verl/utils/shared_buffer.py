"""CPU tensors shared by file name (torch's ``file_system`` strategy) and the /dev/shm names they leave behind.

torch removes such a name when the last mapping of it closes (a reference count kept in the file) or, as
a backstop, when its ``torch_shm_manager`` sees every client gone. A holder that is SIGKILLed never
decrements the count, and a kill of a process tree takes the manager with it: SGLang's schedulers map a
rank's rollout buffer and are SIGKILLed at every engine shutdown, so each CPU run left that buffer (one
rank's rollout weights) in /dev/shm. :func:`unlink_if_unmapped` removes the name once this process is done
with it.
"""

from __future__ import annotations

import _posixshmem
import os

import torch

SHM_DIR = "/dev/shm"


def shared_name(tensor: torch.Tensor) -> str:
    """The POSIX shared-memory name (``/torch_<pid>_<n>_<k>``) of a CPU tensor moved to shared memory under
    the ``file_system`` strategy; it does not change the file's reference count."""
    storage = tensor.untyped_storage()
    if not storage.is_shared():
        raise ValueError("shared_name: expected a tensor in shared memory (share_memory_()), found a private one")
    return storage._share_filename_cpu_()[1].decode()


def mapped_here(name: str) -> bool:
    """Whether this process still maps the shared-memory file ``name``."""
    path = os.path.join(SHM_DIR, name.lstrip("/"))
    names = (path, path + " (deleted)")
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
        # address perms offset dev inode [path]
        return any(len(fields := line.rstrip("\n").split(maxsplit=5)) == 6 and fields[5] in names for line in fh)


def unlink_if_unmapped(name: str) -> bool:
    """Remove ``name`` from /dev/shm once this process holds no mapping of it; True if this call removed it.

    Call it after dropping every reference to the tensor. While this process still maps the file the name is
    kept: torch unlinks it itself when that mapping's count reaches 0, and aborts the process if the name
    is gone by then. Mappings other processes hold stay valid; only opening the name again fails.
    """
    if mapped_here(name):
        return False
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:  # the last mapping closed cleanly and torch removed it
        return False
    return True
