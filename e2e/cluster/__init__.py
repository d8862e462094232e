"""End-to-end tests on the real node (e2e/node): real KubeRay, kubelet, containerd, our images."""
