"""The node's processes: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
containerd, kubelet, kube-proxy, CoreDNS and kube-router (network policies), each in the
node's network namespace, their configuration and identities; pids in
``.cluster/node/state.json`` (stopped by pid, checked against their command lines).
:mod:`e2e.node.lifecycle` puts them together."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import secrets
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, Final

from e2e.controlplane import cluster
from e2e.node import config, host

REPO: Final = pathlib.Path(__file__).resolve().parents[2]
STATE: Final = "state.json"
#: Start order; ``down`` stops in reverse (the API server last but one, etcd last).
COMPONENTS: Final = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "containerd",
    "kubelet",
    "kube-proxy",
    "coredns",
    "kube-router",
)
#: What each component's command line must contain for ``down`` to signal its pid.
MARKERS: Final = (
    b"etcd",
    b"kube-apiserver",
    b"kube-controller-manager",
    b"kube-scheduler",
    b"containerd",
    b"kubelet",
    b"kube-proxy",
    b"coredns",
    b"kube-router",
)


class NodeError(RuntimeError):
    """The node could not be built, started or reached."""


def log(message: str) -> None:
    print(f"[node] {message}", flush=True)


@dataclasses.dataclass
class Node:
    """A running node: the admin view of its API (``plane``), its processes and paths."""

    paths: config.Paths
    pids: dict[str, int]
    plane: cluster.ControlPlane
    #: Fixed host directories cluster-up created (removed again by down).
    created: list[str] = dataclasses.field(default_factory=list)
    #: Seconds per start-up step (printed at the end of cluster-up).
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.plane.kubectl(*args, **kwargs)

    def env(self) -> dict[str, str]:
        return self.plane.env()

    def alive(self) -> bool:
        return all(cluster.pid_alive(pid) for pid in self.pids.values())

    def save(self) -> None:
        state = {
            "pids": self.pids,
            "created": self.created,
            "admin_token": self.plane.admin_token,
            "timings": self.timings,
        }
        (self.paths.node / STATE).write_text(json.dumps(state, indent=2) + "\n")


def binaries() -> dict[str, str]:
    bin_dir = config.cache_dir() / "bin"
    names = [c for c in COMPONENTS if c != "containerd"]
    out = {name: str(bin_dir / name) for name in names}
    out["containerd"] = "/usr/bin/containerd"
    return out


DEBIAN_PACKAGES: Final = {
    "/usr/bin/containerd": "containerd",
    "/usr/sbin/runc": "runc",
    "/usr/lib/cni/bridge": "containernetworking-plugins",
    "/usr/sbin/iptables": "iptables",
    "/usr/sbin/ipset": "ipset",
    "/usr/sbin/conntrack": "conntrack",
    "/usr/bin/nsenter": "util-linux",
}


def ensure_packages() -> None:
    """Debian's containerd, runc, CNI plugins, iptables and ipset (installed when missing)."""
    missing = sorted(
        {pkg for path, pkg in DEBIAN_PACKAGES.items() if not pathlib.Path(path).exists()}
    )
    if not missing:
        return
    log(f"installing Debian packages: {' '.join(missing)}")
    done = subprocess.run(["bash", str(REPO / "scripts" / "apt-install.sh"), *missing], check=False)
    if done.returncode != 0:
        raise NodeError(f"could not install {' '.join(missing)} (see the [apt] lines above)")


def ensure_built() -> None:
    """The Kubernetes binaries, CoreDNS, kube-router and the images (cached; builds print
    progress)."""
    for cmd in (
        ["bash", str(REPO / "e2e" / "controlplane" / "build.sh"), "--node"],
        ["bash", str(REPO / "images" / "build.sh")],
    ):
        if subprocess.run(cmd, check=False).returncode != 0:
            raise NodeError(f"{' '.join(cmd)} failed (its output is above)")


# --- configuration files -----------------------------------------------------------------------


def write_pki_and_kubeconfigs(paths: config.Paths) -> str:
    """Certificates, the static token file and one kubeconfig per identity (made once per
    ``.cluster``); the admin token."""
    pki = paths.pki
    tokens_file = paths.node / "tokens.csv"
    identities = [paths.kubeconfig_of(name) for name in config.IDENTITIES]
    if (
        not (pki / "ca.crt").exists()
        or not tokens_file.exists()
        or not all(path.exists() for path in identities)  # a component added since
    ):
        cluster.generate_pki(
            pki, sans=[f"IP:{config.NODE_IP_VETH}", f"IP:{config.KUBERNETES_SERVICE_IP}"]
        )
        cluster.client_certificate(
            pki,
            "apiserver-kubelet-client",
            cn="kube-apiserver-kubelet-client",
            org="system:masters",
        )
        lines = []
        for name, (user, groups) in config.IDENTITIES.items():
            token = secrets.token_hex(24)
            lines.append(
                f'{token},{user},{user},"{groups}"' if groups else f"{token},{user},{user}"
            )
            cluster.write_kubeconfig(
                paths.kubeconfig_of(name),
                server=config.server(),
                ca_file=pki / "ca.crt",
                token=token,
                user=user,
            )
        tokens_file.write_text("\n".join(lines) + "\n")
        tokens_file.chmod(0o600)
    # The user's kubeconfig (the contract: .cluster/kubeconfig).
    admin = paths.kubeconfig_of("admin")
    paths.kubeconfig.write_bytes(admin.read_bytes())
    paths.kubeconfig.chmod(0o600)
    first = tokens_file.read_text().splitlines()[0]
    return first.split(",", 1)[0]


def write_configs(paths: config.Paths) -> dict[str, pathlib.Path]:
    files = {
        "containerd": (paths.node / "containerd.toml", config.containerd_config(paths)),
        "cni": (paths.cni_conf / "10-elastic-moe.conflist", config.cni_config(paths)),
        "kubelet": (paths.node / "kubelet.yaml", config.kubelet_config(paths)),
        "kube-proxy": (paths.node / "kube-proxy.yaml", config.kube_proxy_config(paths)),
        "coredns": (paths.node / "Corefile", config.corefile(paths)),
    }
    out = {}
    for name, (path, text) in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        out[name] = path
    return out


def commands(paths: config.Paths, files: dict[str, pathlib.Path]) -> dict[str, list[str]]:
    """Each component's command line (before the network-namespace prefix)."""
    b = binaries()
    pki = paths.pki
    kc = paths.kubeconfig_of
    return {
        "etcd": [
            b["etcd"], "--name=node", f"--data-dir={paths.etcd_data}",
            "--listen-client-urls=http://127.0.0.1:2379",
            "--advertise-client-urls=http://127.0.0.1:2379",
            "--listen-peer-urls=http://127.0.0.1:2380",
            "--initial-advertise-peer-urls=http://127.0.0.1:2380",
            "--initial-cluster=node=http://127.0.0.1:2380",
            "--unsafe-no-fsync", "--snapshot-count=100000",
        ],
        "kube-apiserver": [
            b["kube-apiserver"], "--etcd-servers=http://127.0.0.1:2379",
            f"--bind-address={config.NODE_IP_VETH}", f"--advertise-address={config.NODE_IP_VETH}",
            f"--secure-port={config.APISERVER_PORT}", f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'server.crt'}", f"--tls-private-key-file={pki / 'server.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-cluster-ip-range={config.SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            f"--token-auth-file={paths.node / 'tokens.csv'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            "--kubelet-preferred-address-types=InternalIP",
            "--enable-priority-and-fairness=false", "--profiling=false",
            "--allow-privileged=false",
        ],
        "kube-controller-manager": [
            b["kube-controller-manager"], f"--kubeconfig={kc('kube-controller-manager')}",
            f"--authentication-kubeconfig={kc('kube-controller-manager')}",
            f"--authorization-kubeconfig={kc('kube-controller-manager')}",
            "--bind-address=127.0.0.1", "--leader-elect=false",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={config.SERVICE_CIDR}", "--allocate-node-cidrs=false",
            "--controllers=*",
            "--profiling=false",
        ],
        "kube-scheduler": [
            b["kube-scheduler"], f"--kubeconfig={kc('kube-scheduler')}",
            f"--authentication-kubeconfig={kc('kube-scheduler')}",
            f"--authorization-kubeconfig={kc('kube-scheduler')}",
            "--bind-address=127.0.0.1", "--leader-elect=false", "--profiling=false",
        ],
        "containerd": [b["containerd"], "--config", str(files["containerd"])],
        "kubelet": [
            b["kubelet"], f"--config={files['kubelet']}", f"--kubeconfig={kc('kubelet')}",
            f"--root-dir={paths.kubelet}", f"--cert-dir={paths.kubelet / 'pki'}",
            f"--hostname-override={config.NODE_NAME}", f"--node-ip={config.NODE_IP}", "--v=1",
        ],
        "kube-proxy": [b["kube-proxy"], f"--config={files['kube-proxy']}", "--v=1"],
        "coredns": [b["coredns"], "-conf", str(files["coredns"])],
        # Only the network-policy controller: no BGP routing, no IPVS service proxy
        # (kube-proxy is the proxy), no load-balancer allocator; no metrics.
        "kube-router": [
            b["kube-router"], f"--kubeconfig={kc('kube-router')}",
            f"--hostname-override={config.NODE_NAME}",
            "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
            "--run-loadbalancer=false", "--enable-ipv4=true", "--enable-ipv6=false",
            f"--service-cluster-ip-range={config.SERVICE_CIDR}",
            f"--health-port={config.KUBE_ROUTER_HEALTH_PORT}", "--metrics-port=0", "--v=1",
        ],
    }  # fmt: skip


# --- start -------------------------------------------------------------------------------------


def wait_for(
    what: str, ready: Callable[[], bool], *, node: Node, timeout: float, names: Sequence[str]
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for name in names:
            if not cluster.pid_alive(node.pids[name]):
                raise NodeError(
                    f"{name} exited while waiting for {what}:\n"
                    f"{cluster.log_tail(node.paths.logs / f'{name}.log')}"
                )
        if time.monotonic() > deadline:
            tails = "\n".join(
                f"--- {n}:\n{cluster.log_tail(node.paths.logs / f'{n}.log', 15)}" for n in names
            )
            raise NodeError(f"{what} not ready after {timeout:.0f}s\n{tails}")
        time.sleep(0.2)


def start_process(node: Node, name: str, cmd: list[str]) -> None:
    """Start one component in the node's network namespace (the kubelet also in a mount
    namespace of its own) and record its pid."""
    if name == "kubelet":
        full = host.kubelet_wrapper(node.paths, cmd)
    else:
        full = [*host.in_netns(), *cmd]
    node.pids[name] = cluster.spawn(
        full, log=node.paths.logs / f"{name}.log", die_with_parent=False
    )
    node.save()


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our own endpoint
            return bool(response.status == 200)
    except OSError:
        return False


def node_ready(node: Node) -> bool:
    path = '{.status.conditions[?(@.type=="Ready")].status}'
    done = node.kubectl("get", "node", config.NODE_NAME, "-o", f"jsonpath={path}", check=False)
    return done.returncode == 0 and done.stdout.strip() == "True"


# --- attach / stop -----------------------------------------------------------------------------


def attach(paths: config.Paths) -> Node | None:
    """The node recorded in ``paths``, whether or not it still runs (``None``: none recorded)."""
    try:
        state: dict[str, Any] = json.loads((paths.node / STATE).read_text())
    except (OSError, ValueError):
        return None
    plane = cluster.ControlPlane(
        state_dir=paths.node,
        server=config.server(),
        kubeconfig=paths.kubeconfig,
        admin_token=str(state.get("admin_token") or ""),
        ca_file=paths.pki / "ca.crt",
        pids={},
        etcd_data_dir=paths.etcd_data,
        owned=False,
    )
    return Node(
        paths=paths,
        pids={k: int(v) for k, v in (state.get("pids") or {}).items()},
        plane=plane,
        created=list(state.get("created") or []),
        timings=dict(state.get("timings") or {}),
    )


def healthy(node: Node) -> bool:
    return (
        node.alive()
        and set(node.pids) == set(COMPONENTS)
        and cluster.readyz(config.server(), node.paths.pki / "ca.crt", token=node.plane.admin_token)
        and node_ready(node)
    )


def stop_processes(node: Node, names: Sequence[str]) -> None:
    """Stop the named components (SIGTERM, SIGKILL after a grace period), in that order."""
    pids = {n: node.pids[n] for n in names if n in node.pids}
    cluster.stop_pids(pids, markers=MARKERS, order=list(pids), grace=15.0)
    for name in pids:
        node.pids.pop(name, None)
