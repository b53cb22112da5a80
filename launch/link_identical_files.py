"""Hard-link a venv's installed files to byte-identical copies in other venvs on the same file system.

    python launch/link_identical_files.py TARGET_VENV SOURCE_VENV [SOURCE_VENV ...]

The engine venvs (.venv-sglang, .venv-vllm) each hold the same torch 2.13.0+cpu wheel as .venv, and the two engine
venvs the same triton: about 2.5 GB of identical shared libraries on a shared node's disk (and on CI's). A file under
the target's site-packages is replaced by a hard link to the source's file at the same relative path only when both
are regular files of equal size, mode and content, and it is neither a Python source nor its bytecode. The
replacement is atomic (link to a temporary name, then rename), so an interrupted run leaves every file whole. pip
never rewrites an installed file in place (it removes and writes anew), so a later install into either venv only
unlinks its own copy. Sources on another file system, or missing, are skipped. Prints the bytes freed."""

import filecmp
import os
import stat
import sys
import sysconfig


def site_packages(venv: str) -> str:
    """<venv>/lib/pythonX.Y/site-packages, as this interpreter lays a venv out."""
    rel = os.path.relpath(sysconfig.get_paths()["purelib"], sysconfig.get_paths()["data"])
    return os.path.join(venv, rel)


def link_identical(target: str, sources: list[str]) -> tuple[int, int]:
    """(files, bytes freed) after each regular file under ``target`` is a hard link to the first source's identical
    file at the same relative path (sources in order of preference; one on another file system is skipped)."""
    dev = os.stat(target).st_dev
    sources = [s for s in sources if os.path.isdir(s) and os.stat(s).st_dev == dev]
    count = freed = 0
    for root, dirs, files in os.walk(target):
        rel = os.path.relpath(root, target)
        others = [os.path.join(s, rel) for s in sources if os.path.isdir(os.path.join(s, rel))]
        if not others:
            dirs[:] = []  # a package only the target has: nothing below it to share
            continue
        for name in files:
            mine = os.path.join(root, name)
            a = os.lstat(mine)
            # Python sources and their bytecode stay each venv's own: a .pyc records its source's mtime, and a
            # source linked to another venv's takes that file's mtime, so every import would find the bytecode
            # stale and compile again (the shared libraries are where the bytes are anyway).
            if not stat.S_ISREG(a.st_mode) or a.st_size == 0 or name.endswith((".py", ".pyc")):
                continue
            for other_root in others:
                theirs = os.path.join(other_root, name)
                try:
                    b = os.lstat(theirs)
                except FileNotFoundError:
                    continue
                if b.st_ino == a.st_ino:
                    break  # shared already
                # one inode has one mode: files whose modes differ stay apart
                if (not stat.S_ISREG(b.st_mode) or b.st_size != a.st_size or b.st_mode != a.st_mode
                        or not filecmp.cmp(mine, theirs, shallow=False)):
                    continue
                tmp = f"{mine}.verl-link-{os.getpid()}"
                os.link(theirs, tmp)
                os.replace(tmp, mine)
                count += 1
                freed += a.st_size if a.st_nlink == 1 else 0  # another link kept the old copy alive
                break
    return count, freed


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("link_identical_files: expected TARGET_VENV SOURCE_VENV [...], found "
              f"{len(argv)} argument(s)", file=sys.stderr)
        return 2
    target = site_packages(argv[0])
    if not os.path.isdir(target):
        print(f"link_identical_files: expected a venv at {argv[0]}, found no {target}", file=sys.stderr)
        return 2
    files, freed = link_identical(target, [site_packages(venv) for venv in argv[1:]])
    print(f"link_identical_files: {files} files of {argv[0]} linked to identical files of {' '.join(argv[1:])} "
          f"({freed / 2**30:.2f} GiB freed)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
