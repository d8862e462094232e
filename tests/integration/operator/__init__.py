"""Operator integration tests against a real kube-apiserver + etcd, real kopf and kubectl."""
