"""The node's cost on this 2-core machine: RSS and CPU of each process of the stack (and of
the containerd shims), and the memory and CPU of all pods (the kubepods cgroup)."""

from __future__ import annotations

import os
import pathlib
import time

from e2e.node import stack

_HZ = os.sysconf("SC_CLK_TCK")


def _ticks(pid: int) -> int:
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


def _rss_mib(pid: int) -> float:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def shim_pids(node: stack.Node) -> list[int]:
    needle = f"-address {node.paths.containerd_socket}".encode()
    out = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            raw = cmdline.read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"containerd-shim" in raw and needle in raw:
            out.append(int(cmdline.parent.name))
    return out


def _cgroup(controller: str, name: str) -> int | None:
    try:
        return int(pathlib.Path(f"/sys/fs/cgroup/{controller}/kubepods/{name}").read_text())
    except (OSError, ValueError):
        return None


def table(node: stack.Node, *, window: float = 10.0) -> str:
    """RSS now and CPU (% of one core) over ``window`` seconds, per process and in total."""
    pids = dict(node.pids)
    shims = shim_pids(node)
    before = {name: _ticks(pid) for name, pid in pids.items()}
    shim_before = sum(_ticks(pid) for pid in shims)
    pods_before = _cgroup("cpuacct", "cpuacct.usage")
    time.sleep(window)
    rows = [f"{'process':<26}{'RSS MiB':>10}{'CPU % of a core':>18}"]
    total_rss = total_cpu = 0.0
    for name, pid in pids.items():
        rss = _rss_mib(pid)
        cpu = (_ticks(pid) - before[name]) * 100 / _HZ / window
        total_rss, total_cpu = total_rss + rss, total_cpu + cpu
        rows.append(f"{name:<26}{rss:>10.0f}{cpu:>18.1f}")
    rss = sum(_rss_mib(pid) for pid in shims)
    cpu = (sum(_ticks(pid) for pid in shims) - shim_before) * 100 / _HZ / window
    total_rss, total_cpu = total_rss + rss, total_cpu + cpu
    rows.append(f"{f'containerd shims ({len(shims)})':<26}{rss:>10.0f}{cpu:>18.1f}")
    rows.append(f"{'Kubernetes stack':<26}{total_rss:>10.0f}{total_cpu:>18.1f}")
    memory = _cgroup("memory", "memory.usage_in_bytes")
    pods_after = _cgroup("cpuacct", "cpuacct.usage")
    if memory is not None and pods_before is not None and pods_after is not None:
        pod_cpu = (pods_after - pods_before) / 1e9 * 100 / window
        rows.append(f"{'pods (kubepods cgroup)':<26}{memory / 2**20:>10.0f}{pod_cpu:>18.1f}")
    return "\n".join(rows)
