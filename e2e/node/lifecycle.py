"""The node's life: ``up`` (build what is missing, start everything, install KubeRay and our
operator, print timings and the stack's memory and idle CPU), ``down`` (stop everything it
started, leave no container and no host state behind).

From the shell: ``python -m e2e.node up|down|status`` (what ``make cluster-up`` /
``make cluster-down`` run); from pytest: :func:`up` / :func:`down`.
"""

from __future__ import annotations

import pathlib
import time

from e2e.controlplane import cluster
from e2e.node import config, host, install, measure, stack


def start(paths: config.Paths, *, timeout: float = 180.0) -> stack.Node:
    """Every component from a stopped state (the caller removed anything left first)."""
    t0 = time.monotonic()
    for path in (paths.node, paths.logs, paths.pod_logs):
        path.mkdir(parents=True, exist_ok=True)
    created = [] if host.KUBELET_FIXED_DIR.exists() else [str(host.KUBELET_FIXED_DIR)]
    token = stack.write_pki_and_kubeconfigs(paths)
    files = stack.write_configs(paths)
    cmds = stack.commands(paths, files)
    plane = cluster.ControlPlane(
        state_dir=paths.node,
        server=config.server(),
        kubeconfig=paths.kubeconfig,
        admin_token=token,
        ca_file=paths.pki / "ca.crt",
        pids={},
        etcd_data_dir=paths.etcd_data,
        owned=False,
    )
    node = stack.Node(paths=paths, pids={}, plane=plane, created=created)
    mark = time.monotonic()

    def step(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        node.timings[name] = round(now - mark, 1)
        stack.log(f"{name} ({now - mark:.1f}s; {now - t0:.1f}s in all)")
        mark = now

    try:
        host.create_network()
        step("network namespace, veth and pod bridge ready")
        paths.etcd_data.mkdir(parents=True, exist_ok=True)
        stack.start_process(node, "etcd", cmds["etcd"])
        stack.start_process(node, "kube-apiserver", cmds["kube-apiserver"])
        stack.wait_for(
            "kube-apiserver /readyz",
            lambda: cluster.readyz(config.server(), paths.pki / "ca.crt", token=token),
            node=node, timeout=timeout, names=("etcd", "kube-apiserver"),
        )  # fmt: skip
        stack.start_process(node, "kube-controller-manager", cmds["kube-controller-manager"])
        stack.start_process(node, "kube-scheduler", cmds["kube-scheduler"])
        step(f"control plane {config.K8S_VERSION} up")
        paths.containerd_state.mkdir(parents=True, exist_ok=True)
        stack.start_process(node, "containerd", cmds["containerd"])
        stack.wait_for(
            "containerd",
            lambda: install.ctr("version", check=False, paths=paths).returncode == 0,
            node=node, timeout=30, names=("containerd",),
        )  # fmt: skip
        install.import_images(node)
        step("containerd up, images imported")
        host.prepare_kubelet_dirs(paths)
        stack.start_process(node, "kubelet", cmds["kubelet"])
        stack.wait_for(
            f"node {config.NODE_NAME} Ready", lambda: stack.node_ready(node),
            node=node, timeout=timeout, names=("kubelet", "containerd"),
        )  # fmt: skip
        step(f"kubelet {config.K8S_VERSION} up, node Ready")
        node.kubectl(
            "apply", "--server-side", "--field-manager=elastic-moe-node", "-f", "-",
            input=config.COREDNS_RBAC + "---\n" + config.KUBE_ROUTER_RBAC,
        )  # fmt: skip
        stack.start_process(node, "kube-proxy", cmds["kube-proxy"])
        stack.start_process(node, "coredns", cmds["coredns"])
        stack.start_process(node, "kube-router", cmds["kube-router"])
        coredns = f"http://{config.NODE_IP_VETH}:{config.COREDNS_READY_PORT}/ready"
        proxy = f"http://{config.NODE_IP_VETH}:{config.KUBE_PROXY_HEALTH_PORT}/healthz"
        router = f"http://{config.NODE_IP_VETH}:{config.KUBE_ROUTER_HEALTH_PORT}/healthz"
        stack.wait_for(
            "kube-proxy, CoreDNS and kube-router",
            lambda: stack.http_ok(coredns) and stack.http_ok(proxy) and stack.http_ok(router),
            node=node, timeout=60, names=("kube-proxy", "coredns", "kube-router"),
        )  # fmt: skip
        step("kube-proxy, CoreDNS and kube-router (network policies) ready")
        install.install_kuberay(node)
        step(f"KubeRay {config.KUBERAY_VERSION} operator running as a pod")
        install.install_operator(node)
        step("elastic-moe CRD installed, operator running as a pod")
    except BaseException:
        stack.log("start-up failed; stopping what was started (logs in .cluster/node/logs)")
        stop(node)
        raise
    node.timings["total"] = round(time.monotonic() - t0, 1)
    node.save()
    return node


def stop(node: stack.Node) -> None:
    """Pods first (the kubelet tears their sandboxes and CNI state down), then every recorded
    process, then whatever containerd still runs, then the host state."""
    if "kubelet" in node.pids and cluster.pid_alive(node.pids["kubelet"]):
        install.delete_all_pods(node)
    stack.stop_processes(
        node,
        [
            "kube-router",
            "coredns",
            "kube-proxy",
            "kubelet",
            "kube-scheduler",
            "kube-controller-manager",
        ],
    )
    if "containerd" in node.pids and cluster.pid_alive(node.pids["containerd"]):
        install.remove_containers(node.paths)
    stack.stop_processes(node, ["containerd", "kube-apiserver", "etcd"])
    install.kill_leftover_shims(node.paths)
    host.cleanup_mounts(node.paths)
    host.cleanup_pod_netns()
    host.delete_network()
    host.cleanup_cgroups()
    host.remove_dirs(node.paths, created=node.created)
    (node.paths.node / stack.STATE).unlink(missing_ok=True)


def up(state: pathlib.Path, *, build: bool = True) -> stack.Node:
    """Idempotent: reuse a healthy node (re-importing rebuilt images and re-applying our
    manifests), else clean up what is left and start one."""
    paths = config.Paths(state=state.resolve())
    stack.ensure_packages()
    if build:
        stack.ensure_built()
    node = stack.attach(paths)
    if node is not None and stack.healthy(node):
        imported = install.import_images(node)
        operator_changed = any(name.startswith(install.OPERATOR_IMAGE_REPO) for name in imported)
        install.install_operator(node, restart=operator_changed)
        stack.log(f"reusing the running node (kubeconfig {paths.kubeconfig})")
        return node
    if node is not None:
        stack.log("a node was recorded but is not healthy: cleaning it up first")
        stop(node)
    elif host.netns_exists():
        stop(stack.Node(paths=paths, pids={}, plane=_plane(paths)))
    before = host.sysctls()
    node = start(paths)
    after = host.sysctls()
    changed = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) != v}
    if changed:
        stack.log(f"WARNING: host settings changed while starting: {changed}")
    return node


def down(state: pathlib.Path) -> bool:
    """Stop the node recorded in ``state``; False when none was recorded or left."""
    paths = config.Paths(state=state.resolve())
    node = stack.attach(paths)
    if node is None:
        if not host.netns_exists():
            return False
        node = stack.Node(paths=paths, pids={}, plane=_plane(paths))
    stop(node)
    left = host.leftover_cgroups()
    if left:
        stack.log(f"WARNING: cgroups left: {left}")
    return True


def _plane(paths: config.Paths) -> cluster.ControlPlane:
    return cluster.ControlPlane(
        state_dir=paths.node,
        server=config.server(),
        kubeconfig=paths.kubeconfig,
        admin_token="",
        ca_file=paths.pki / "ca.crt",
        pids={},
        etcd_data_dir=paths.etcd_data,
        owned=False,
    )


def report(node: stack.Node, *, window: float = 10.0) -> str:
    """Start-up timings and the stack's memory and idle CPU over ``window`` seconds."""
    lines = ["start-up:"]
    lines += [f"  {name:<55} {seconds:6.1f}s" for name, seconds in node.timings.items()]
    lines.append(measure.table(node, window=window))
    return "\n".join(lines)


def restart(node: stack.Node, name: str, *, timeout: float = 120.0) -> float:
    """Stop one component of a running node and start it again with the same command (chaos
    tests: a kube-apiserver restart); the seconds it was away."""
    files = {
        "containerd": node.paths.node / "containerd.toml",
        "cni": node.paths.cni_conf / "10-elastic-moe.conflist",
        "kubelet": node.paths.node / "kubelet.yaml",
        "kube-proxy": node.paths.node / "kube-proxy.yaml",
        "coredns": node.paths.node / "Corefile",
    }
    cmd = stack.commands(node.paths, files)[name]
    started = time.monotonic()
    stack.stop_processes(node, [name])
    stack.start_process(node, name, cmd)
    if name == "kube-apiserver":
        stack.wait_for(
            "kube-apiserver /readyz",
            lambda: cluster.readyz(config.server(), node.paths.pki / "ca.crt", token=node.plane.admin_token),
            node=node, timeout=timeout, names=("etcd", "kube-apiserver"),
        )  # fmt: skip
    return time.monotonic() - started
