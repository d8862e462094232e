"""Names, addresses, paths and the configuration files of the node (data in, text out).

Network layout (all of it created by :mod:`e2e.node.host`, removed by ``cluster-down``)::

    this machine ── emoe-h 10.243.0.1/30 ══ veth ══ emoe-n 10.243.0.2/30 ── netns emoe-node
                                                                              │ kube-apiserver :6443
                                                                              │ etcd, kcm, scheduler,
                                                                              │ containerd, kubelet,
                                                                              │ kube-proxy, CoreDNS,
                                                                              │ kube-router (policies)
                                                           bridge emoe0 10.244.0.1/24
                                                              └── pods 10.244.0.0/24

The node's network namespace forwards between the bridge, its loopback and the veth (its own
``ip_forward``); this machine's stays off. Pods reach the API server through the
``kubernetes`` Service (kube-proxy, endpoint 10.243.0.2:6443) and each other by Service or
DNS name (CoreDNS on 10.244.0.1:53). From this machine: kubectl against 10.243.0.2:6443,
``kubectl port-forward`` for pod ports, or pod and Service IPs directly (routes for 10.244.0.0/24
and 10.96.0.0/16 over the veth: traffic that does not depend on the API server).

NetworkPolicies are enforced: kube-router's network-policy controller (only that part of
kube-router) turns them into iptables rules and ipsets in the node's namespace, for traffic
between pods on the bridge (bridged frames go through iptables there:
``net.bridge.bridge-nf-call-iptables`` is set in the node's namespace only) and from this
machine over the veth.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Final

K8S_VERSION: Final = os.environ.get("MOE_K8S_VERSION", "v1.36.3")
KUBERAY_VERSION: Final = os.environ.get("MOE_KUBERAY_VERSION", "v1.5.0")

NETNS: Final = "emoe-node"
VETH_HOST: Final = "emoe-h"
VETH_NODE: Final = "emoe-n"
HOST_IP: Final = "10.243.0.1"
NODE_IP_VETH: Final = "10.243.0.2"  # the API server and the health endpoints the host polls
VETH_PREFIX: Final = 30
BRIDGE: Final = "emoe0"
POD_CIDR: Final = "10.244.0.0/24"
NODE_IP: Final = "10.244.0.1"  # the node's InternalIP (kubelet, CoreDNS)
SERVICE_CIDR: Final = "10.96.0.0/16"
KUBERNETES_SERVICE_IP: Final = "10.96.0.1"
NODE_NAME: Final = "elastic-moe-node"
#: The context name in the kubeconfigs e2e.controlplane.cluster.write_kubeconfig writes.
KUBECONFIG_CONTEXT: Final = "elastic-moe-local"
CLUSTER_DOMAIN: Final = "cluster.local"

APISERVER_PORT: Final = 6443
KUBELET_PORT: Final = 10250
COREDNS_READY_PORT: Final = 8181
COREDNS_HEALTH_PORT: Final = 8080
KUBE_PROXY_HEALTH_PORT: Final = 10256
#: kube-router's health endpoint (``/healthz``; it listens on every address of the node's
#: network namespace, which only the veth and the pod bridge reach).
KUBE_ROUTER_HEALTH_PORT: Final = 20244
KUBE_ROUTER_VERSION: Final = os.environ.get("MOE_KUBE_ROUTER_VERSION", "v2.1.0")

#: Namespaces the stack installs into.
KUBERAY_NAMESPACE: Final = "kuberay-system"
OPERATOR_NAMESPACE: Final = "elastic-moe-system"
KUBERAY_IMAGE: Final = f"quay.io/kuberay/operator:{KUBERAY_VERSION}"
PAUSE_IMAGE: Final = "registry.k8s.io/pause:3.10"


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MOE_CACHE", pathlib.Path.home() / ".cache" / "elastic-moe"))


@dataclasses.dataclass(frozen=True)
class Paths:
    """Where the node keeps things. ``state`` is the checkout's ``.cluster/``; ``run`` and
    ``kubelet`` are fixed host paths (one node per machine); containerd's content store lives
    in the cache so imported images survive ``cluster-down``."""

    state: pathlib.Path
    run: pathlib.Path = pathlib.Path("/run/elastic-moe")
    kubelet: pathlib.Path = pathlib.Path("/var/lib/elastic-moe/kubelet")

    @property
    def node(self) -> pathlib.Path:
        return self.state / "node"

    @property
    def kubeconfig(self) -> pathlib.Path:
        return self.state / "kubeconfig"

    @property
    def pki(self) -> pathlib.Path:
        return self.node / "pki"

    @property
    def logs(self) -> pathlib.Path:
        return self.node / "logs"

    @property
    def pod_logs(self) -> pathlib.Path:
        return self.node / "pod-logs"

    @property
    def cni_conf(self) -> pathlib.Path:
        return self.node / "cni"

    @property
    def containerd_root(self) -> pathlib.Path:
        return cache_dir() / "node" / "containerd"

    @property
    def containerd_state(self) -> pathlib.Path:
        return self.run / "containerd"

    @property
    def containerd_socket(self) -> pathlib.Path:
        return self.run / "containerd.sock"

    @property
    def sysctl_shadow(self) -> pathlib.Path:
        return self.run / "kubelet-sysctl"

    @property
    def etcd_data(self) -> pathlib.Path:
        return pathlib.Path("/dev/shm/elastic-moe-node-etcd")

    def kubeconfig_of(self, component: str) -> pathlib.Path:
        return self.node / f"{component}.kubeconfig"


def server() -> str:
    return f"https://{NODE_IP_VETH}:{APISERVER_PORT}"


#: Users of the static token file: name -> (user, groups). ``admin`` is the kubeconfig the
#: tests and the user get; the rest are the components' own identities (RBAC binds the
#: ``system:*`` ones by default, CoreDNS gets its ClusterRole from :mod:`e2e.node.install`).
IDENTITIES: Final = {
    "admin": ("admin", "system:masters"),
    "kube-controller-manager": ("system:kube-controller-manager", ""),
    "kube-scheduler": ("system:kube-scheduler", ""),
    "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),
    "kube-proxy": ("system:kube-proxy", ""),
    "coredns": ("coredns", ""),
    "kube-router": ("system:kube-router", ""),
}


def containerd_config(paths: Paths) -> str:
    """containerd 1.6 with the CRI plugin, its own root, state and socket (Docker's containerd,
    if any, is left alone)."""
    return f"""version = 2
root = "{paths.containerd_root}"
state = "{paths.containerd_state}"
# This VM lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj below the caller's own.
oom_score = 0

[grpc]
  address = "{paths.containerd_socket}"

[ttrpc]
  address = ""

[debug]
  level = "warn"

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "{PAUSE_IMAGE}"
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    # the kubelet asks for -998 for sandboxes; without CAP_SYS_RESOURCE that fails in runc
    restrict_oom_score_adj = true
    enable_unprivileged_ports = false
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      discard_unpacked_layers = false
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
          Root = "{paths.run / "runc"}"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "{paths.cni_conf}"
  [plugins."io.containerd.internal.v1.opt"]
    path = "{paths.run / "opt"}"
"""


def cni_config(paths: Paths) -> str:
    """Bridge + host-local IPAM on the pod bridge, portmap, firewall (accepts pod traffic in
    FORWARD whatever its policy)."""
    conf = {
        "cniVersion": "1.0.0",
        "name": "elastic-moe",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(paths.run / "cni-ipam"),
                    "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
            {"type": "firewall"},
        ],
    }
    return json.dumps(conf, indent=2) + "\n"


def kubelet_config(paths: Paths) -> str:
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# kubelet >= 1.35 refuses cgroup v1 unless told (KEP-5573); this VM is cgroup v1 (hybrid)
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://{paths.containerd_socket}
address: {NODE_IP}
port: {KUBELET_PORT}
healthzBindAddress: 127.0.0.1
healthzPort: 10248
readOnlyPort: 0
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {paths.pki / "ca.crt"}}}
authorization:
  mode: Webhook
clusterDomain: {CLUSTER_DOMAIN}
clusterDNS: [{NODE_IP}]
# no upstream resolvers: nothing in the cluster resolves or reaches names outside it
resolvConf: ""
podLogsDir: {paths.pod_logs}
rotateCertificates: false
serverTLSBootstrap: false
failSwapOn: false
maxPods: 40
serializeImagePulls: false
evictionHard:
  memory.available: 200Mi
  nodefs.available: 3%
  imagefs.available: 3%
imageGCHighThresholdPercent: 97
imageGCLowThresholdPercent: 95
# no CAP_SYS_RESOURCE on this VM: the kubelet cannot lower its own oom_score_adj
oomScoreAdj: 0
containerLogMaxSize: 20Mi
shutdownGracePeriod: 0s
"""


def kube_proxy_config(paths: Paths) -> str:
    """iptables mode, every Service connection masqueraded (replies come back through the
    node, whatever the bridge's netfilter setting); no conntrack or route_localnet sysctl is
    written."""
    return f"""apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {paths.kubeconfig_of("kube-proxy")}
hostnameOverride: {NODE_NAME}
mode: iptables
clusterCIDR: {POD_CIDR}
bindAddress: {NODE_IP}
healthzBindAddress: {NODE_IP_VETH}:{KUBE_PROXY_HEALTH_PORT}
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: ["{NODE_IP}/32"]
iptables:
  masqueradeAll: true
  localhostNodePorts: false
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"""


def corefile(paths: Paths) -> str:
    """Cluster DNS only: ``*.cluster.local`` from the API, nothing forwarded anywhere else."""
    return f""".:53 {{
    bind {NODE_IP}
    errors
    health {NODE_IP_VETH}:{COREDNS_HEALTH_PORT}
    ready {NODE_IP_VETH}:{COREDNS_READY_PORT}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {paths.kubeconfig_of("coredns")} {KUBECONFIG_CONTEXT}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
    loop
    loadbalance
}}
"""


COREDNS_RBAC: Final = """apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns"}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: coredns}
"""


#: kube-router's network-policy controller: it reads policies, pods and namespaces (and, as
#: every kube-router starts its informers for them, services, endpoints and nodes); it writes
#: nothing to the API. Its own daemonset's ClusterRole, less what the router, the service
#: proxy and the load-balancer allocator need.
KUBE_ROUTER_RBAC: Final = """apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:kube-router"}
rules:
- apiGroups: [""]
  resources: [namespaces, pods, services, nodes, endpoints]
  verbs: [get, list, watch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:kube-router"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:kube-router"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:kube-router"}
"""
