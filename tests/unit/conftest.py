"""Fixtures shared by the unit tests that run `moe-runtime serve` in process."""

from __future__ import annotations

import pathlib
import signal
from collections.abc import Iterator

import pytest

from moe_contract import loading


@pytest.fixture
def termination_log(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """The termination-log file serve writes its failure into (the kubelet makes the file;
    the runtime only writes it)."""
    path = tmp_path / "termination-log"
    path.write_text("")
    monkeypatch.setenv(loading.TERMINATION_LOG_ENV, str(path))
    return path


@pytest.fixture
def keep_sigterm() -> Iterator[None]:
    """The SIGTERM handler as it was (serve installs its own)."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)
