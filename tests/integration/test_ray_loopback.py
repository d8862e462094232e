"""The local Ray instance (the tests' and `moe-runtime serve`'s without RAY_ADDRESS) stays on
loopback: its node address is 127.0.0.1 and no process of it listens on another address."""

from __future__ import annotations

import ipaddress
import os
import pathlib
from typing import Any

import pytest

pytestmark = pytest.mark.ray

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp*


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _listening() -> dict[str, str]:
    """inode -> the address a TCP socket listens on, from /proc/net/tcp and tcp6."""
    out = {}
    for name, width in (("tcp", 8), ("tcp6", 32)):
        for line in pathlib.Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            raw = bytes.fromhex(fields[1].split(":")[0][:width])
            # the kernel prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(words)
            mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:a.b.c.d is IPv4 a.b.c.d
            out[fields[9]] = str(mapped or address)
    return out


def test_the_local_instance_listens_on_loopback_only(ray_session: None) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def node_ip(self) -> Any:
            return ray.util.get_node_ip_address()

    probe = Probe.remote()  # type: ignore[attr-defined]
    try:
        assert ray.get(probe.node_ip.remote(), timeout=60) == "127.0.0.1"
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        listening = _listening()
        ours = {
            pid: [listening[i] for i in _socket_inodes(pid) if i in listening]
            for pid in _descendants(os.getpid())
        }
        addresses = {a for found in ours.values() for a in found}
        assert addresses, "no listening socket found in the Ray processes"
        wide = {
            pid: a
            for pid, a in ours.items()
            if any(not ipaddress.ip_address(x).is_loopback for x in a)
        }
        assert not wide, f"listening beyond loopback: {wide}"
    finally:
        ray.kill(probe)
