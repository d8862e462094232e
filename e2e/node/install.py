"""What runs on the node once it is Ready: the images imported into its containerd, the real
KubeRay operator installed with its own manifests (kustomize, from its Go module), our CRD and
operator from ``manifests/``; and the teardown of pods and containers.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pathlib
import posixpath
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from typing import Any, Final

from e2e.controlplane import cluster
from e2e.kube import Kubectl
from e2e.node import config, stack

#: Images the node imports (tarballs made by images/build.sh), by image name.
OPERATOR_IMAGE_REPO: Final = "ghcr.io/elastic-moe/operator"
RUNTIME_IMAGE_REPO: Final = "ghcr.io/elastic-moe/runtime"


def ctr(
    *args: str, check: bool = True, paths: config.Paths | None = None
) -> subprocess.CompletedProcess[str]:
    """containerd's ``ctr`` against the node's containerd, in the CRI namespace."""
    socket = (paths or config.Paths(state=stack.REPO / ".cluster")).containerd_socket
    cmd = ["ctr", "-a", str(socket), "-n", "k8s.io", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise stack.NodeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def project_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("elastic-moe")


def image_tarballs() -> dict[str, pathlib.Path]:
    images = config.cache_dir() / "images"
    names = [
        config.PAUSE_IMAGE,
        config.KUBERAY_IMAGE,
        f"{OPERATOR_IMAGE_REPO}:{project_version()}",
        f"{RUNTIME_IMAGE_REPO}:{project_version()}",
    ]
    out = {}
    for name in names:
        tar = images / (name.replace("/", "_").replace(":", "_") + ".tar")
        if not tar.exists():
            raise stack.NodeError(f"image {name} is not built ({tar} missing): run `make images`")
        out[name] = tar
    return out


def qualified_name(name: str) -> str:
    """The name containerd stores an image under (Docker's normalisation: a first component
    without a dot or a colon is a Docker Hub repository)."""
    first, _, rest = name.partition("/")
    if not rest:
        return f"docker.io/library/{name}"
    if "." in first or ":" in first or first == "localhost":
        return name
    return f"docker.io/{name}"


def import_images(node: stack.Node) -> list[str]:
    """Import every image whose build differs from what containerd holds; the names imported.

    containerd's content store lives in the cache, so a rebuilt node imports nothing new; a
    stamp beside it holds the Docker image id last imported under each name. Only the layers
    containerd lacks are handed over (:func:`delta_archive`): after a code change that is the
    top layer of the runtime image, not its 6 GB of dependencies.
    """
    stamps = node.paths.containerd_root / "elastic-moe-imported.json"
    try:
        done: dict[str, str] = json.loads(stamps.read_text())
    except (OSError, ValueError):
        done = {}
    present = set(ctr("images", "ls", "-q", paths=node.paths).stdout.split())
    imported = []
    for name, tar in image_tarballs().items():
        id_file = tar.with_suffix(".tar.id")
        want = id_file.read_text().strip() if id_file.exists() else ""
        if done.get(name) == want and want and qualified_name(name) in present:
            continue
        started = time.monotonic()
        blobs = set(ctr("content", "ls", "-q", paths=node.paths).stdout.split())
        with tempfile.TemporaryDirectory(dir=node.paths.containerd_root) as tmp:
            archive = pathlib.Path(tmp) / "image.tar"
            size = delta_archive(tar, archive, name=qualified_name(name), present=blobs)
            stack.log(f"importing {name} ({size / 1e9:.2f} GB new) into the node's containerd")
            try:
                ctr("images", "import", str(archive), paths=node.paths)
            except stack.NodeError as error:
                # A blob can outlive the snapshot unpacked from it (containerd's garbage
                # collector drops snapshots no image references): the delta then names a
                # parent that is not there. The whole image always imports.
                stack.log(f"  the delta import failed ({error}); importing the whole image")
                ctr("images", "import", str(tar), paths=node.paths)
        done[name] = want
        stamps.write_text(json.dumps(done, indent=2) + "\n")
        imported.append(name)
        stack.log(f"  imported in {time.monotonic() - started:.1f}s")
    return imported


def delta_archive(
    docker_tar: pathlib.Path, out: pathlib.Path, *, name: str, present: set[str]
) -> int:
    """An OCI image archive of the ``docker save`` tarball's image holding only the layer blobs
    not in ``present`` (containerd resolves the others from its content store when it
    unpacks); the bytes of layers written. Layers stay uncompressed: their digests are the
    image's diff ids, as when containerd imports the docker archive itself."""
    with tarfile.open(docker_tar) as src:
        manifest = json.load(_member(src, "manifest.json"))[0]
        config_bytes = _member(src, manifest["Config"]).read()
        config = json.loads(config_bytes)
        diff_ids: list[str] = config["rootfs"]["diff_ids"]
        layers, written = [], 0
        with tarfile.open(out, "w") as dst:
            for path, digest in zip(manifest["Layers"], diff_ids, strict=True):
                info = _resolve(src, path)
                layers.append({"mediaType": OCI_LAYER, "digest": digest, "size": info.size})
                if digest in present or f"blobs/sha256/{digest[7:]}" in dst.getnames():
                    continue
                blob = tarfile.TarInfo(f"blobs/sha256/{digest[7:]}")
                blob.size = info.size
                dst.addfile(blob, src.extractfile(info))
                written += info.size
            image_manifest = json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": OCI_MANIFEST,
                    "config": {
                        "mediaType": OCI_CONFIG,
                        "digest": _digest(config_bytes),
                        "size": len(config_bytes),
                    },
                    "layers": layers,
                }
            ).encode()
            index = json.dumps(
                {
                    "schemaVersion": 2,
                    "manifests": [
                        {
                            "mediaType": OCI_MANIFEST,
                            "digest": _digest(image_manifest),
                            "size": len(image_manifest),
                            "annotations": {
                                "io.containerd.image.name": name,
                                "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1],
                            },
                        }
                    ],
                }
            ).encode()
            for member, data in (
                ("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'),
                (f"blobs/sha256/{_digest(config_bytes)[7:]}", config_bytes),
                (f"blobs/sha256/{_digest(image_manifest)[7:]}", image_manifest),
                ("index.json", index),
            ):
                entry = tarfile.TarInfo(member)
                entry.size = len(data)
                dst.addfile(entry, io.BytesIO(data))
    return written


OCI_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG: Final = "application/vnd.oci.image.config.v1+json"
OCI_LAYER: Final = "application/vnd.oci.image.layer.v1.tar"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _resolve(archive: tarfile.TarFile, path: str) -> tarfile.TarInfo:
    """A member of a docker archive, following the symlinks ``docker save`` uses for layers
    shared by several of its entries."""
    info = archive.getmember(path)
    while info.issym():
        path = posixpath.normpath(posixpath.join(posixpath.dirname(path), info.linkname))
        info = archive.getmember(path)
    return info


def _member(archive: tarfile.TarFile, path: str) -> Any:
    handle = archive.extractfile(_resolve(archive, path))
    if handle is None:
        raise stack.NodeError(f"{path} is not a file in the image archive")
    return handle


# --- KubeRay -----------------------------------------------------------------------------------


def kuberay_module_dir() -> pathlib.Path:
    """``github.com/ray-project/kuberay/ray-operator@VERSION`` in the Go module cache."""
    module = f"github.com/ray-project/kuberay/ray-operator@{config.KUBERAY_VERSION}"
    done = subprocess.run(
        ["go", "mod", "download", "-json", module],
        capture_output=True, text=True, cwd=config.cache_dir(), check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise stack.NodeError(f"go mod download {module} failed: {done.stderr.strip()}")
    return pathlib.Path(json.loads(done.stdout)["Dir"])


def wait_available(
    node: stack.Node, namespace: str, deployment: str, *, timeout: float = 180
) -> None:
    """Poll until the Deployment has an available replica of its current generation."""
    deadline = time.monotonic() + timeout
    path = "{.status.observedGeneration}/{.metadata.generation}/{.status.availableReplicas}/{.status.updatedReplicas}"
    while True:
        done = node.kubectl(
            "-n", namespace, "get", "deployment", deployment, "-o", f"jsonpath={path}", check=False
        )
        observed, generation, available, updated = (done.stdout.split("/") + ["", "", "", ""])[:4]
        if (
            done.returncode == 0
            and observed == generation
            and available not in ("", "0")
            and updated not in ("", "0")
        ):
            return
        if time.monotonic() > deadline:
            pods = node.kubectl("-n", namespace, "get", "pods", "-o", "wide", check=False).stdout
            raise stack.NodeError(
                f"deployment {namespace}/{deployment} not available after {timeout:.0f}s:\n{pods}"
            )
        time.sleep(0.5)


def ensure_namespace(node: Kubectl, name: str, *, labels: dict[str, str] | None = None) -> None:
    manifest = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": labels or {}},
    }
    node.kubectl(
        "apply",
        "--server-side",
        "--field-manager=elastic-moe-node",
        "-f",
        "-",
        input=json.dumps(manifest),
    )


def install_kuberay(node: stack.Node) -> None:
    """KubeRay's own ``config/default`` (CRDs, RBAC, the manager Deployment) from its Go
    module, into ``kuberay-system``; the image is the one images/build.sh built from the same
    module under KubeRay's own name."""
    overlay = node.paths.node / "kuberay"
    shutil.rmtree(overlay, ignore_errors=True)
    shutil.copytree(kuberay_module_dir() / "config", overlay / "config")
    for path in overlay.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        f"namespace: {config.KUBERAY_NAMESPACE}\n"
        "resources:\n"
        "  - config/default\n"
    )
    ensure_namespace(node, config.KUBERAY_NAMESPACE)
    node.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager=elastic-moe-node",
        "-k", str(overlay), timeout=180,
    )  # fmt: skip
    cluster.wait_established(
        node.plane, ["rayclusters.ray.io", "rayjobs.ray.io", "rayservices.ray.io"]
    )
    wait_available(node, config.KUBERAY_NAMESPACE, "kuberay-operator")


def install_operator(node: stack.Node, *, restart: bool = False) -> None:
    """Our CRD and operator, exactly as a user installs them: ``kubectl apply --server-side -k
    manifests/`` (its ServiceAccount and RBAC are what the tests run under)."""
    node.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager=elastic-moe-node",
        "-k", str(stack.REPO / "manifests"), timeout=120,
    )  # fmt: skip
    cluster.wait_established(node.plane, ["moedeployments.elasticmoe.io"])
    if restart:
        node.kubectl(
            "-n", config.OPERATOR_NAMESPACE, "rollout", "restart", "deployment/moe-operator"
        )
    wait_available(node, config.OPERATOR_NAMESPACE, "moe-operator")


# --- teardown ----------------------------------------------------------------------------------


def delete_all_pods(node: stack.Node, *, timeout: float = 90.0) -> None:
    """Delete every workload so the kubelet tears sandboxes down (CNI DEL frees IPs and rules)."""
    kinds = "rayclusters.ray.io,moedeployments.elasticmoe.io,deployments,replicasets,pods"
    node.kubectl(
        "delete", kinds, "--all", "--all-namespaces", "--wait=false", check=False, timeout=60
    )
    node.kubectl(
        "delete",
        "pods",
        "--all",
        "--all-namespaces",
        "--grace-period=5",
        "--wait=false",
        check=False,
        timeout=60,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = node.kubectl("get", "pods", "--all-namespaces", "-o", "name", check=False)
        if done.returncode != 0 or not done.stdout.strip():
            return
        time.sleep(0.5)
    stack.log(f"pods still there after {timeout:.0f}s; containers are removed directly")


def remove_containers(paths: config.Paths | None = None) -> None:
    """Kill and remove every task and container containerd still has (sandboxes included)."""
    for task in ctr("tasks", "ls", "-q", check=False, paths=paths).stdout.split():
        ctr("tasks", "kill", "-s", "SIGKILL", task, check=False, paths=paths)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        tasks = ctr("tasks", "ls", "-q", check=False, paths=paths).stdout.split()
        for task in tasks:
            ctr("tasks", "rm", "-f", task, check=False, paths=paths)
        if not tasks:
            break
        time.sleep(0.2)
    for container in ctr("containers", "ls", "-q", check=False, paths=paths).stdout.split():
        ctr("containers", "rm", container, check=False, paths=paths)


def kill_leftover_shims(paths: config.Paths) -> None:
    """containerd shims of the node's containerd that outlived it (matched by its socket)."""
    needle = f"-address {paths.containerd_socket}".encode()
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError, ValueError):
            raw = cmdline.read_bytes()
            if b"containerd-shim" in raw and needle in raw.replace(b"\0", b" "):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
