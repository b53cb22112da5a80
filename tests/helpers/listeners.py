"""The TCP listening sockets of a process tree, read from /proc (no psutil): each one's address and port."""

from __future__ import annotations

import ipaddress
import os


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (parent links from /proc/<pid>/stat)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ")"
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parent.items() if ppid in frontier]
        tree += frontier
    return tree


def _address(hex_addr: str) -> str:
    """/proc/net/tcp[6]'s hex address (32-bit words in host byte order, little-endian here) -> text."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening_sockets(pids) -> list[tuple[str, int, int]]:
    """(address, port, pid) of each TCP socket in LISTEN state that one of ``pids`` holds open."""
    owner = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[target[len("socket:["):-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in owner:  # 0A: TCP_LISTEN
                addr, port = cols[1].split(":")
                found.append((_address(addr), int(port, 16), owner[cols[9]]))
    return found


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback
