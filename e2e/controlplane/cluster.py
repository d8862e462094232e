"""Start and stop a local control plane: etcd and kube-apiserver on 127.0.0.1.

Binaries come from ``build.sh`` (cached under ``$MOE_CACHE``, default ``~/.cache/elastic-moe``).
Each start picks free loopback ports, keeps etcd's data on ``/dev/shm`` (``--unsafe-no-fsync``),
generates a CA, a serving certificate and service-account keys with ``openssl``, writes a
kubeconfig with an admin token, waits for ``/readyz`` and installs KubeRay's RayCluster CRD and
the project's ``crds/``. There is no controller-manager: no pods, no garbage collection.

Used from pytest (``start()`` / ``ControlPlane.stop()``) and from the shell::

    python -m e2e.controlplane.cluster up --dir .cluster     # idempotent
    python -m e2e.controlplane.cluster down --dir .cluster

Standard library only, so it also runs outside the project's virtual environment.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import dataclasses
import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "e2e" / "controlplane" / "build.sh"
SERVICE_CIDR = "10.0.0.0/16"
SERVICE_IP = "10.0.0.1"
CLUSTER_NAME = "elastic-moe-local"
STATE_FILE = "state.json"
RAYCLUSTER_CRD = "ray.io_rayclusters.yaml"


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MOE_CACHE", pathlib.Path.home() / ".cache" / "elastic-moe"))


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or reached."""


class KubectlError(subprocess.CalledProcessError):
    """kubectl failed; the message carries its stderr."""

    def __str__(self) -> str:
        return f"kubectl {' '.join(self.cmd[3:])} exited {self.returncode}: {self.stderr.strip()}"


@dataclasses.dataclass
class ControlPlane:
    """A running control plane and the means to use it."""

    state_dir: pathlib.Path
    server: str
    kubeconfig: pathlib.Path
    admin_token: str
    ca_file: pathlib.Path
    pids: dict[str, int]
    etcd_data_dir: pathlib.Path
    owned: bool = True  # False when attached to one started by another process
    remove_state_dir: bool = False  # True when start() made a temporary one

    def env(self) -> dict[str, str]:
        """The environment for a process that should talk to this control plane."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(
        self,
        *args: str,
        input: str | None = None,  # noqa: A002 - mirrors subprocess.run
        check: bool = True,
        timeout: float = 120.0,
        kubeconfig: pathlib.Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this control plane; raise ``KubectlError`` on failure
        when ``check``."""
        cmd = ["kubectl", "--kubeconfig", str(kubeconfig or self.kubeconfig), *args]
        done = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise KubectlError(done.returncode, cmd, done.stdout, done.stderr)
        return done

    def write_kubeconfig(self, path: pathlib.Path, *, token: str, user: str) -> pathlib.Path:
        """Write a kubeconfig for another identity (e.g. a service-account token)."""
        write_kubeconfig(path, server=self.server, ca_file=self.ca_file, token=token, user=user)
        return path

    def ready(self) -> bool:
        return readyz(self.server, self.ca_file)

    def alive(self) -> bool:
        return all(pid_alive(pid) for pid in self.pids.values())

    def stop(self) -> None:
        """Stop etcd and kube-apiserver and remove etcd's data."""
        stop_pids(self.pids)
        shutil.rmtree(self.etcd_data_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / STATE_FILE).unlink()
        if self.remove_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def save(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "admin_token": self.admin_token,
            "ca_file": str(self.ca_file),
            "pids": self.pids,
            "etcd_data_dir": str(self.etcd_data_dir),
        }
        (self.state_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


# --- build -------------------------------------------------------------------------------------


def binaries() -> dict[str, pathlib.Path]:
    bin_dir = cache_dir() / "bin"
    return {"etcd": bin_dir / "etcd", "kube-apiserver": bin_dir / "kube-apiserver"}


def ensure_built() -> None:
    """Run ``build.sh`` (a no-op when its cache stamp is current)."""
    done = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ControlPlaneError(f"build.sh failed:\n{done.stdout}\n{done.stderr}")


# --- helpers -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child counts as dead.
    with contextlib.suppress(OSError):
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            return False
    return True


def _is_ours(pid: int, markers: Sequence[bytes] = (b"etcd", b"kube-apiserver")) -> bool:
    """Whether ``pid`` still runs one of our binaries (pids can be reused)."""
    try:
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(marker in cmdline for marker in markers)


def stop_pids(
    pids: dict[str, int],
    *,
    grace: float = 10.0,
    markers: Sequence[bytes] = (b"etcd", b"kube-apiserver"),
    order: Sequence[str] = ("kube-apiserver",),
) -> None:
    """SIGTERM (then SIGKILL after ``grace``) each pid that still runs one of ``markers``;
    the names in ``order`` first (the API server before etcd, so it does not spin on a
    vanished etcd), then the rest in reverse start order."""
    rest = [name for name in reversed(list(pids)) if name not in order]
    for name in [*(n for n in order if n in pids), *rest]:
        pid = pids[name]
        if pid_alive(pid) and _is_ours(pid, markers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid) and _is_ours(pid, markers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args)} failed: {done.stderr}")


def generate_pki(pki: pathlib.Path, *, sans: Sequence[str] = ()) -> None:
    """A CA, the API server's serving certificate (127.0.0.1 and ``sans``, e.g.
    ``IP:10.243.0.2``) and service-account keys."""
    pki.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
        "-subj", "/CN=elastic-moe-local-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-addext", "subjectKeyIdentifier=hash",
        cwd=pki,
    )  # fmt: skip
    (pki / "server.ext").write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n"
        f"subjectAltName=IP:127.0.0.1,IP:{SERVICE_IP},DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,"
        "DNS:kubernetes.default.svc.cluster.local" + "".join(f",{san}" for san in sans) + "\n"
    )
    _openssl(
        "req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=kube-apiserver",
        cwd=pki,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "3650", "-extfile", "server.ext",
        cwd=pki,
    )  # fmt: skip
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "sa.key",
        cwd=pki,
    )  # fmt: skip
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def client_certificate(pki: pathlib.Path, name: str, *, cn: str, org: str | None = None) -> None:
    """``name.crt`` / ``name.key``: a client certificate signed by the CA (``O=org``, ``CN=cn``),
    e.g. the one the API server shows the kubelet for ``kubectl logs/exec/port-forward``."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (pki / "client.ext").write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=clientAuth\n"
    )
    subject = (f"/O={org}" if org else "") + f"/CN={cn}"
    _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=pki)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", "3650", "-extfile", "client.ext",
        cwd=pki,
    )  # fmt: skip


def write_kubeconfig(
    path: pathlib.Path, *, server: str, ca_file: pathlib.Path, token: str, user: str
) -> None:
    """A kubeconfig (JSON is valid YAML) for ``user`` authenticating with ``token``."""
    ca_data = base64.b64encode(ca_file.read_bytes()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CLUSTER_NAME,
                "cluster": {"server": server, "certificate-authority-data": ca_data},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {
                "name": CLUSTER_NAME,
                "context": {"cluster": CLUSTER_NAME, "user": user, "namespace": "default"},
            }
        ],
        "current-context": CLUSTER_NAME,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.chmod(0o600)
    tmp.replace(path)


def readyz(server: str, ca_file: pathlib.Path, *, token: str | None = None) -> bool:
    context = ssl.create_default_context(cafile=str(ca_file))
    request = urllib.request.Request(f"{server}/readyz")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, context=context, timeout=2) as response:  # noqa: S310
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def log_tail(path: pathlib.Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def _cleanup_on_error(pids: dict[str, int], data_dir: pathlib.Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        stop_pids(pids, grace=3.0)
        shutil.rmtree(data_dir, ignore_errors=True)
        raise


# --- start -------------------------------------------------------------------------------------


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the process that started us exits (Linux), so a killed
    pytest does not leave etcd and kube-apiserver behind (SIGTERM is not enough: without etcd,
    kube-apiserver's graceful shutdown never ends)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _remove_stale_etcd_dirs(parent: pathlib.Path) -> None:
    """Remove etcd data dirs left in ``parent`` by killed runs (no etcd process uses them)."""
    in_use: set[str] = set()
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            for arg in cmdline.read_bytes().split(b"\0"):
                if arg.startswith(b"--data-dir="):
                    in_use.add(arg.split(b"=", 1)[1].decode(errors="replace"))
    for stale in parent.glob("elastic-moe-etcd-*"):
        if str(stale) not in in_use and time.time() - stale.stat().st_mtime > 60:
            shutil.rmtree(stale, ignore_errors=True)


def spawn(
    cmd: Sequence[str],
    *,
    log: pathlib.Path,
    die_with_parent: bool,
    env: dict[str, str] | None = None,
) -> int:
    """Start ``cmd`` in its own session, output appended to ``log``; its pid."""
    with log.open("ab") as out:
        proc = subprocess.Popen(  # noqa: S603 - our own binaries
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # no stray terminal signals (Ctrl-C goes to pytest only)
            preexec_fn=_die_with_parent if die_with_parent else None,  # noqa: PLW1509
            env=env,
        )
    return proc.pid


def _start_once(
    *, state_dir: pathlib.Path, timeout: float, die_with_parent: bool
) -> tuple[str, dict[str, int], pathlib.Path]:
    bins = binaries()
    pki = state_dir / "pki"
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    shm = pathlib.Path("/dev/shm")
    if shm.is_dir():
        _remove_stale_etcd_dirs(shm)
    data_dir = pathlib.Path(
        tempfile.mkdtemp(prefix="elastic-moe-etcd-", dir=shm if shm.is_dir() else state_dir)
    )
    client, peer, secure = free_port(), free_port(), free_port()
    pids: dict[str, int] = {}
    with _cleanup_on_error(pids, data_dir):
        pids["etcd"] = spawn(
            [
                str(bins["etcd"]),
                "--name=local",
                f"--data-dir={data_dir}",
                f"--listen-client-urls=http://127.0.0.1:{client}",
                f"--advertise-client-urls=http://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=local=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
                "--snapshot-count=100000",
            ],
            log=logs / "etcd.log",
            die_with_parent=die_with_parent,
        )
        server = f"https://127.0.0.1:{secure}"
        pids["kube-apiserver"] = spawn(
            [
                str(bins["kube-apiserver"]),
                f"--etcd-servers=http://127.0.0.1:{client}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={secure}",
                f"--cert-dir={pki}",
                f"--tls-cert-file={pki / 'server.crt'}",
                f"--tls-private-key-file={pki / 'server.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=RBAC",
                f"--token-auth-file={state_dir / 'tokens.csv'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--endpoint-reconciler-type=none",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                "--allow-privileged=false",
            ],
            log=logs / "kube-apiserver.log",
            die_with_parent=die_with_parent,
        )
        ca_file = pki / "ca.crt"
        deadline = time.monotonic() + timeout
        while not readyz(server, ca_file):
            for name, pid in pids.items():
                if not pid_alive(pid):
                    raise ControlPlaneError(
                        f"{name} exited during start-up:\n{log_tail(logs / f'{name}.log')}"
                    )
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"kube-apiserver not ready after {timeout:.0f}s:\n"
                    f"{log_tail(logs / 'kube-apiserver.log')}"
                )
            time.sleep(0.1)
    return server, pids, data_dir


def crd_files() -> list[pathlib.Path]:
    """KubeRay's RayCluster CRD (from the cache) and every CRD in the repository's ``crds/``."""
    ours = [p for p in sorted((REPO / "crds").glob("*.yaml")) if p.name != "kustomization.yaml"]
    return [cache_dir() / "crds" / RAYCLUSTER_CRD, *ours]


def install_crds(plane: ControlPlane, files: Sequence[pathlib.Path]) -> None:
    """Server-side apply the CRDs and wait until they are served."""
    if not files:
        return
    args = ["apply", "--server-side", "--field-manager=elastic-moe-controlplane"]
    for path in files:
        args += ["-f", str(path)]
    done = plane.kubectl(*args, "-o", "name")
    names = [line.split("/", 1)[-1] for line in done.stdout.split() if line]
    wait_established(plane, names)


def wait_established(plane: ControlPlane, names: Sequence[str], *, timeout: float = 60.0) -> None:
    """Poll until every named CRD is Established (``kubectl wait`` errors out while a new CRD
    has no conditions yet)."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while True:
        done = plane.kubectl("get", "crd", *names, "-o", "json", check=False)
        if done.returncode == 0:
            body = json.loads(done.stdout)
            items = body.get("items", [body]) if body.get("kind") == "List" else [body]
            states = {
                item["metadata"]["name"]: next(
                    (
                        c.get("status", "")
                        for c in (item.get("status") or {}).get("conditions") or []
                        if c.get("type") == "Established"
                    ),
                    "",
                )
                for item in items
            }
            if all(states.get(name) == "True" for name in names):
                return
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"CRDs not established after {timeout:.0f}s: {states}")
        time.sleep(0.1)


def start(
    *,
    state_dir: pathlib.Path | None = None,
    crds: Sequence[pathlib.Path] | None = None,
    timeout: float = 90.0,
    attempts: int = 3,
    die_with_parent: bool = True,
) -> ControlPlane:
    """Build if needed, start etcd + kube-apiserver, write the kubeconfig, install CRDs.

    ``state_dir`` holds certificates, logs, the token file and the kubeconfig (a fresh temporary
    directory when omitted, removed again by ``stop()``). ``crds`` defaults to
    :func:`crd_files`. ``die_with_parent``: etcd and kube-apiserver exit with the calling
    process (off for ``up``, whose control plane outlives the command).
    """
    ensure_built()
    temporary = state_dir is None
    state_dir = pathlib.Path(state_dir or tempfile.mkdtemp(prefix="elastic-moe-cp-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    pki = state_dir / "pki"
    generate_pki(pki)
    token = secrets.token_hex(24)
    tokens = state_dir / "tokens.csv"
    tokens.write_text(f'{token},admin,admin,"system:masters"\n')
    tokens.chmod(0o600)
    last: ControlPlaneError | None = None
    for _ in range(attempts):  # a picked port can be taken by someone else meanwhile
        try:
            server, pids, data_dir = _start_once(
                state_dir=state_dir, timeout=timeout, die_with_parent=die_with_parent
            )
        except ControlPlaneError as error:
            last = error
            continue
        break
    else:
        raise ControlPlaneError(f"control plane did not start: {last}")
    kubeconfig = state_dir / "kubeconfig"
    write_kubeconfig(kubeconfig, server=server, ca_file=pki / "ca.crt", token=token, user="admin")
    plane = ControlPlane(
        state_dir=state_dir,
        server=server,
        kubeconfig=kubeconfig,
        admin_token=token,
        ca_file=pki / "ca.crt",
        pids=pids,
        etcd_data_dir=data_dir,
        remove_state_dir=temporary,
    )
    plane.save()
    try:
        install_crds(plane, crd_files() if crds is None else crds)
    except BaseException:
        plane.stop()
        raise
    return plane


def attach(state_dir: pathlib.Path) -> ControlPlane | None:
    """The control plane recorded in ``state_dir``, when it still runs and answers."""
    try:
        state: dict[str, Any] = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    plane = ControlPlane(
        state_dir=state_dir,
        server=state["server"],
        kubeconfig=pathlib.Path(state["kubeconfig"]),
        admin_token=state["admin_token"],
        ca_file=pathlib.Path(state["ca_file"]),
        pids={k: int(v) for k, v in state["pids"].items()},
        etcd_data_dir=pathlib.Path(state["etcd_data_dir"]),
        owned=False,
    )
    return plane


def up(state_dir: pathlib.Path) -> ControlPlane:
    """Idempotent: reuse the control plane recorded in ``state_dir`` when healthy."""
    plane = attach(state_dir)
    if plane is not None:
        if plane.alive() and plane.ready():
            install_crds(plane, crd_files())  # cheap; picks up regenerated CRDs
            return plane
        plane.stop()
    plane = start(state_dir=state_dir, die_with_parent=False)
    plane.owned = False
    return plane


def down(state_dir: pathlib.Path) -> bool:
    """Stop the control plane recorded in ``state_dir``; False when none was recorded."""
    plane = attach(state_dir)
    if plane is None:
        return False
    plane.stop()
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.controlplane.cluster")
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=pathlib.Path, default=REPO / ".cluster")
    args = parser.parse_args(argv)
    state_dir = args.dir.resolve()
    if args.command == "up":
        started = time.monotonic()
        plane = up(state_dir)
        print(f"control plane up at {plane.server} ({time.monotonic() - started:.1f}s)")
        print(f"export KUBECONFIG={plane.kubeconfig}")
        return 0
    if args.command == "down":
        print("control plane stopped" if down(state_dir) else "no control plane recorded")
        return 0
    found = attach(state_dir)
    healthy = found is not None and found.alive() and found.ready()
    print(f"control plane {'up at ' + found.server if found and healthy else 'down'}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
