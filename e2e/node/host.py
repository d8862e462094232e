"""The host state the node needs, made and removed again: its network namespace, the veth pair
to this machine, the pod bridge, the CNI firewall chains, the kubelet's mounts and cgroups.

Nothing here changes a setting of this machine's own network namespace: forwarding, NAT and
every iptables rule of the node live in the node's namespace, which ``cluster-down`` deletes.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import subprocess
from collections.abc import Sequence
from typing import Final

from e2e.node import config

#: Host settings the kubelet would rewrite (it runs with these files bind-mounted read-only,
#: at the values it wants, in a mount namespace of its own) and other ones we must not change.
WATCHED_SYSCTLS: Final = (
    "vm.overcommit_memory",
    "kernel.panic",
    "kernel.panic_on_oops",
    "net.ipv4.ip_forward",
    "net.ipv4.conf.all.route_localnet",
    "net.netfilter.nf_conntrack_max",
)
#: The values the kubelet expects (pkg/kubelet/cm/container_manager_linux.go setupKernelTunables).
KUBELET_SYSCTLS: Final = {
    "vm/overcommit_memory": "1",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
}


class HostError(RuntimeError):
    """A host command failed."""


def run(*cmd: str, check: bool = True, netns: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (inside the node's network namespace when ``netns``)."""
    full = [*in_netns(), *cmd] if netns else list(cmd)
    done = subprocess.run(full, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise HostError(f"{' '.join(full)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def in_netns() -> list[str]:
    """The prefix that runs a command in the node's network namespace (only that namespace:
    mounts stay shared with this machine, so containerd sees the kubelet's volume mounts)."""
    return ["nsenter", f"--net=/run/netns/{config.NETNS}", "--"]


def netns_exists() -> bool:
    return pathlib.Path(f"/run/netns/{config.NETNS}").exists()


def sysctls() -> dict[str, str]:
    """The watched host settings, to check that the node changed none of them."""
    out: dict[str, str] = {}
    for name in WATCHED_SYSCTLS:
        path = pathlib.Path("/proc/sys") / name.replace(".", "/")
        with contextlib.suppress(OSError):
            out[name] = path.read_text().strip()
    return out


def create_network() -> None:
    """The node's network namespace, the veth pair and the pod bridge (idempotent)."""
    if not netns_exists():
        run("ip", "netns", "add", config.NETNS)
    run("ip", "link", "set", "lo", "up", netns=True)
    if run("ip", "link", "show", config.VETH_HOST, check=False).returncode != 0:
        run(
            "ip", "link", "add", config.VETH_HOST, "type", "veth",
            "peer", "name", config.VETH_NODE, "netns", config.NETNS,
        )  # fmt: skip
        run("ip", "addr", "add", f"{config.HOST_IP}/{config.VETH_PREFIX}", "dev", config.VETH_HOST)
        run(
            "ip", "addr", "add", f"{config.NODE_IP_VETH}/{config.VETH_PREFIX}",
            "dev", config.VETH_NODE, netns=True,
        )  # fmt: skip
    run("ip", "link", "set", config.VETH_HOST, "up")
    run("ip", "link", "set", config.VETH_NODE, "up", netns=True)
    # From this machine to pods and Services, through the node (as an in-cluster client):
    # routes for the cluster's own ranges only, over our veth (they go with it).
    for cidr in (config.POD_CIDR, config.SERVICE_CIDR):
        run("ip", "route", "replace", cidr, "via", config.NODE_IP_VETH, "dev", config.VETH_HOST)
    if run("ip", "link", "show", config.BRIDGE, check=False, netns=True).returncode != 0:
        run("ip", "link", "add", config.BRIDGE, "type", "bridge", netns=True)
        run("ip", "addr", "add", f"{config.NODE_IP}/24", "dev", config.BRIDGE, netns=True)
    run("ip", "link", "set", config.BRIDGE, "up", netns=True)
    # Forwarding between the bridge, the veth and loopback, in the node's namespace only.
    run("sysctl", "-q", "-w", "net.ipv4.ip_forward=1", netns=True)
    # Frames between two pods on the bridge go through iptables, where kube-router enforces
    # NetworkPolicies (a new namespace has it on already; said, not assumed).
    run("sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1", netns=True)
    # The CNI firewall plugin creates these on first use; two sandboxes made at once on a
    # fresh namespace race on `iptables -N CNI-ADMIN` and one pod loses ~12 s to backoff.
    ipt = ["iptables", "-w"]
    for chain in ("CNI-FORWARD", "CNI-ADMIN"):
        run(*ipt, "-N", chain, check=False, netns=True)
    rule = ["-m", "comment", "--comment", "CNI firewall plugin rules", "-j", "CNI-FORWARD"]
    if run(*ipt, "-C", "FORWARD", *rule, check=False, netns=True).returncode != 0:
        run(*ipt, "-I", "FORWARD", "1", *rule, netns=True)
    admin = ["-m", "comment", "--comment", "CNI firewall plugin admin overrides", "-j", "CNI-ADMIN"]
    if run(*ipt, "-C", "CNI-FORWARD", *admin, check=False, netns=True).returncode != 0:
        run(*ipt, "-I", "CNI-FORWARD", "1", *admin, netns=True)


def delete_network() -> None:
    """Remove the namespace (with the bridge, the node's end of the veth and all its rules)."""
    if netns_exists():
        run("ip", "netns", "del", config.NETNS, check=False)
    run("ip", "link", "del", config.VETH_HOST, check=False)


def prepare_kubelet_dirs(paths: config.Paths) -> None:
    """The kubelet's root as a shared mount (volume mounts the kubelet makes in its own mount
    namespace show up in this one, where containerd runs), and the sysctl values it wants."""
    paths.kubelet.mkdir(parents=True, exist_ok=True)
    propagation = run("findmnt", "-n", "-o", "PROPAGATION", str(paths.kubelet), check=False)
    if "shared" not in propagation.stdout:
        run("mount", "--bind", str(paths.kubelet), str(paths.kubelet))
        run("mount", "--make-rshared", str(paths.kubelet))
    paths.sysctl_shadow.mkdir(parents=True, exist_ok=True)
    for name, value in KUBELET_SYSCTLS.items():
        (paths.sysctl_shadow / name.replace("/", "-")).write_text(value + "\n")


def kubelet_wrapper(paths: config.Paths, kubelet_cmd: Sequence[str]) -> list[str]:
    """The kubelet in the node's network namespace and a mount namespace of its own in which
    the kernel settings it would rewrite on the host read back as already set."""
    binds = " ".join(
        f"mount --bind -o ro {paths.sysctl_shadow / name.replace('/', '-')} /proc/sys/{name};"
        for name in KUBELET_SYSCTLS
    )
    script = f'set -e; {binds} exec "$@"'
    return [
        *in_netns(),
        "unshare", "--mount", "--propagation", "unchanged", "--",
        "bash", "-c", script, "kubelet", *kubelet_cmd,
    ]  # fmt: skip


def cleanup_mounts(paths: config.Paths) -> None:
    """Unmount what the kubelet left under its root (volumes of pods that were not torn down),
    then the root's own bind mount."""
    done = run("findmnt", "-rn", "-o", "TARGET", check=False)
    under = [m for m in done.stdout.splitlines() if m.startswith(f"{paths.kubelet}/")]
    for target in sorted(under, key=len, reverse=True):
        run("umount", "-l", target, check=False)
    for _ in range(3):  # the bind mount may be stacked if cluster-up ran twice
        if run("umount", "-l", str(paths.kubelet), check=False).returncode != 0:
            break


def cleanup_pod_netns() -> None:
    """Network namespaces of pods whose sandbox was never torn down (CNI names them cni-*)."""
    for ns in pathlib.Path("/run/netns").glob("cni-*"):
        run("umount", str(ns), check=False)
        with contextlib.suppress(OSError):
            ns.unlink()


def cleanup_cgroups() -> None:
    """The kubelet's ``kubepods`` cgroups, innermost first (empty once every pod is gone)."""
    for root in pathlib.Path("/sys/fs/cgroup").glob("*/kubepods"):
        for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if path.is_dir():
                with contextlib.suppress(OSError):
                    path.rmdir()
        with contextlib.suppress(OSError):
            root.rmdir()


def leftover_cgroups() -> list[str]:
    return [str(p) for p in pathlib.Path("/sys/fs/cgroup").glob("*/kubepods")]


#: A path the kubelet's device manager hard-codes whatever its --root-dir.
KUBELET_FIXED_DIR: Final = pathlib.Path("/var/lib/kubelet")
#: containerd's CNI result cache (go-cni's default); our files carry the network's name.
CNI_CACHE: Final = pathlib.Path("/var/lib/cni")


def remove_dirs(paths: config.Paths, *, created: Sequence[str] = ()) -> None:
    """The node's run, kubelet and etcd directories, our CNI cache entries, and the fixed
    directories listed in ``created`` (the ones cluster-up found missing and made)."""
    for path in (paths.run, paths.kubelet, paths.etcd_data):
        shutil.rmtree(path, ignore_errors=True)
    for entry in CNI_CACHE.glob("*/elastic-moe-*"):
        with contextlib.suppress(OSError):
            entry.unlink()
    for name in created:
        shutil.rmtree(name, ignore_errors=True)
