"""The /dev/shm name of a rollout weight buffer shared by file name does not outlive its run when a process
that mapped it was SIGKILLed (SGLang's schedulers at every engine shutdown): verl.utils.shared_buffer."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory in /dev/shm")

# Runs in its own process: the sharing strategy is process-wide, and a wrong unlink aborts the process.
SCENARIO = textwrap.dedent('''
    import io, json, os, signal, subprocess, sys
    from multiprocessing.reduction import ForkingPickler
    import torch, torch.multiprocessing
    from verl.utils.shared_buffer import mapped_here, shared_name, unlink_if_unmapped

    torch.multiprocessing.set_sharing_strategy("file_system")
    HOLDER = ("import pickle, sys, time, torch, torch.multiprocessing\\n"
              "torch.multiprocessing.set_sharing_strategy('file_system')\\n"
              "t = pickle.loads(sys.stdin.buffer.read()); print(float(t.sum()), flush=True); time.sleep(120)")

    def exists(name):
        return os.path.exists("/dev/shm" + name)

    def killed_holder(tensor):
        """A process maps `tensor` from its pickled handle (as an SGLang scheduler does), then is SIGKILLed."""
        handle = io.BytesIO()
        ForkingPickler(handle).dump(tensor)
        proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        proc.stdin.write(handle.getvalue()); proc.stdin.close()
        seen = float(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL); proc.wait()
        return seen

    out = {}
    buf = torch.arange(1000, dtype=torch.float32).share_memory_()
    name = shared_name(buf)
    out["holder_saw"] = killed_holder(buf[10:20])
    out["mapped_while_held"] = mapped_here(name)
    out["unlinked_while_held"] = unlink_if_unmapped(name)
    out["exists_while_held"] = exists(name)
    view = buf[:5]
    del buf
    out["unlinked_while_a_view_lives"] = unlink_if_unmapped(name)
    del view
    out["exists_after_drop"] = exists(name)  # the killed holder's count keeps it: the leak
    out["unlinked_after_drop"] = unlink_if_unmapped(name)
    out["exists_after_unlink"] = exists(name)

    clean = torch.zeros(100).share_memory_()  # nobody else mapped it: torch removes the name itself
    clean_name = shared_name(clean)
    del clean
    out["clean_exists_after_drop"] = exists(clean_name)
    out["clean_unlinked"] = unlink_if_unmapped(clean_name)
    print(json.dumps(out), flush=True)
''')


def test_a_buffer_mapped_by_a_killed_process_leaves_no_name_and_no_abort():
    proc = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=120)
    # A premature unlink would make torch abort the process (SIGABRT) when its last mapping closes.
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["holder_saw"] == sum(range(10, 20))
    assert out["mapped_while_held"] and not out["unlinked_while_held"] and out["exists_while_held"]
    assert not out["unlinked_while_a_view_lives"]
    assert out["exists_after_drop"], "the killed holder should have kept the name (what this module cleans up)"
    assert out["unlinked_after_drop"] and not out["exists_after_unlink"]
    assert not out["clean_exists_after_drop"] and not out["clean_unlinked"]


def test_shared_name_of_a_private_tensor_is_a_clear_error():
    import torch

    from verl.utils.shared_buffer import shared_name

    with pytest.raises(ValueError, match="expected a tensor in shared memory"):
        shared_name(torch.zeros(3))
