"""A real single-node Kubernetes cluster on this machine (`make cluster-up` / `cluster-down`).

etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kube-proxy of one
Kubernetes version (built from its Go module), containerd + runc, CNI bridge networking,
CoreDNS, the real KubeRay operator and our operator as pods. Everything runs in a network
namespace of its own, reached from this machine over one veth pair: nothing listens on the
machine's own interfaces and the machine's network settings stay as they are.
"""
