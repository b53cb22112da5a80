"""The rank's side of :func:`verl.launcher.spawn.run_ranks` (``python -m verl.launcher.function_rank JOB_DIR``).

Started by the one local spawner with torchrun's variables; reads the function and its arguments from the
job's private directory, joins the gloo group over a ``file://`` rendezvous there (no TCP listener), runs
the function and writes its value (or its traceback) back as a file. Exit 0 on success, 1 on failure.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import sys
import time
import traceback

from verl.errors import EXIT_INTERNAL_ERROR
from verl.launcher.bootstrap import DEFAULT_TIMEOUT_S, destroy_distributed, use_shm_collectives
from verl.launcher.spawn import JOB_FILE, RENDEZVOUS_FILE, error_file, result_file


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main(job_dir: str) -> int:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        import torch
        import torch.distributed as dist

        with open(os.path.join(job_dir, JOB_FILE), "rb") as f:
            job = pickle.load(f)  # written by this rank's own parent (run_ranks), as multiprocessing does
        torch.set_num_threads(job["threads"])
        fn = _resolve(*job["fn"])
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(job_dir, RENDEZVOUS_FILE)}",
                                rank=rank, world_size=world_size)
        use_shm_collectives(DEFAULT_TIMEOUT_S)  # as verl train's ranks do
        value = fn(rank, world_size, *job["args"]) if job["with_rank"] else fn(*job["args"])
        buffer = io.BytesIO()
        torch.save(value, buffer)
        tmp = result_file(job_dir, rank) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(buffer.getvalue())
        os.replace(tmp, result_file(job_dir, rank))  # complete or absent
        return 0
    except BaseException:  # noqa: BLE001 - reported to the parent, which ends every rank
        # The time first: the parent names the rank that failed first (its peers fail because it did).
        text = f"{time.time()!r}\n{traceback.format_exc()}"
        tmp = error_file(job_dir, rank) + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, error_file(job_dir, rank))
        return EXIT_INTERNAL_ERROR
    finally:
        destroy_distributed()


if __name__ == "__main__":
    from verl.launcher.bootstrap import exit_process

    exit_process(main(sys.argv[1]))
