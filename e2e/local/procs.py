"""Processes the local stand-ins own: started in their own session, tagged, stopped completely.

Every process started here carries two environment variables that its descendants inherit
(Ray's raylet, agents and worker processes included): ``LOCAL_KUBERAY_OWNER`` (one value per
owner, e.g. one ``LocalKubeRay``) and ``LOCAL_KUBERAY_PROC`` (one value per started process).
Stopping a process sends SIGTERM to it, waits until neither it nor any process carrying its tag
is left, and sends SIGKILL to its process group and to every tagged process past a deadline.
``tagged_pids`` lets tests check that nothing was left behind.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

OWNER_ENV = "LOCAL_KUBERAY_OWNER"
PROC_ENV = "LOCAL_KUBERAY_PROC"

_counter = itertools.count()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the usual race applies; ports are used at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def tagged_pids(name: str, value: str) -> list[int]:
    """Pids of live processes whose environment holds ``name=value`` (zombies excluded)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def _signal_pids(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class Proc:
    """One command run in a new session with its output in ``log_path``."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: Path,
        owner: str,
        name: str,
        cwd: str | Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.tag = f"{owner}.{os.getpid()}.{next(_counter)}"
        self.started_at = time.monotonic()
        self.stop_requested_at: float | None = None
        self._killed = False
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**env, OWNER_ENV: owner, PROC_ENV: self.tag}
        with open(log_path, "ab") as out:
            self._popen = subprocess.Popen(  # noqa: S603 - argv built by the caller
                self.argv,
                env=full_env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self._popen.pid

    def poll(self) -> int | None:
        """The exit code, or None while the leader runs."""
        return self._popen.poll()

    def alive(self) -> bool:
        return self._popen.poll() is None

    def leftovers(self) -> list[int]:
        """Pids still carrying this process's tag (descendants that outlived it included)."""
        return tagged_pids(PROC_ENV, self.tag)

    def request_stop(self) -> None:
        """SIGTERM to the leader (``ray start --block`` then stops its own node gracefully)."""
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self._popen.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the process group and to every process carrying the tag."""
        self._killed = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signal.SIGKILL)
        _signal_pids(self.leftovers(), signal.SIGKILL)
        self._popen.poll()

    def gone(self) -> bool:
        """True when the leader exited and no tagged process is left."""
        return self._popen.poll() is not None and not self.leftovers()

    def progress_stop(self, *, grace_s: float) -> bool:
        """Advance a requested stop without blocking; True once everything is gone."""
        if self.stop_requested_at is None:
            self.request_stop()
        if self.gone():
            return True
        assert self.stop_requested_at is not None
        if time.monotonic() - self.stop_requested_at > grace_s:
            if not self._killed:
                log.warning("%s: still running %.0fs after SIGTERM; killing", self.name, grace_s)
            self.kill()
        return False

    def tail(self, max_bytes: int = 2000) -> str:
        """The end of the log, for error messages."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-max_bytes:].decode(errors="replace")


def stop_all(procs: Sequence[Proc], *, grace_s: float, timeout_s: float = 30.0) -> list[Proc]:
    """Stop ``procs`` together (SIGTERM to all, then SIGKILL past ``grace_s``); block until all
    are gone or ``timeout_s`` passed. Returns those that could not be stopped."""
    for proc in procs:
        proc.request_stop()
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not p.progress_stop(grace_s=grace_s)]
        if pending:
            time.sleep(0.05)  # poll interval of the loop above, not a wait for a condition
    return pending
