"""A local Kubernetes control plane (etcd + kube-apiserver on loopback) for tests and the demo."""
