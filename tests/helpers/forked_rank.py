"""A rank's entry point for the fork server's tests (tests/unit/test_forkserver.py): ``main(argv)`` as
``python -m helpers.forked_rank ARGS`` runs it. It prints what a rank must have (its variables, its pid, whether
its modules came with the fork), then does what argv[0] says: ``exit N``, ``wait`` (until SIGUSR1/SIGTERM, whose
number it prints and exits 0), ``sleep``, ``sighup`` (prints SIGHUP's disposition)."""

import os
import signal
import sys
import time


def main(argv):
    print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} pid {os.getpid()} "
          f"marker {os.environ.get('FORKED_RANK_MARKER', '-')} preloaded {'json.tool' in sys.modules}", flush=True)
    what = argv[0]
    if what == "exit":
        return int(argv[1])
    if what == "sighup":
        ignored = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        print(f"sighup {'ignored' if ignored else 'default'}", flush=True)
        return 0
    if what == "wait":
        got = []
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(signum, lambda s, f: got.append(s))
        print("ready", flush=True)
        while not got:
            time.sleep(0.02)
        print(f"got {got[0]}", flush=True)
        return 0
    if what == "sleep":
        print("ready", flush=True)
        time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
