"""Chaos under load: real `moe-runtime serve --data-parallel-size 3` processes, real kills.

A checked load (greedy and seeded, streamed and not, generations of 24 and 64 tokens, every
answer compared token for token with single-process generation) runs while a rank actor's
process (its pid from /elastic_ep/status) gets SIGKILL, or SIGSTOP (a hang). Each test asserts
that no request failed, that /health never did, that the recovery record names the lost rank,
and prints the detection and recovery times (figures: bench/recovery.py).

One server for the module, autoRecover on (the default): after the SIGKILL it grows back to 3
by itself (a normal resize, trigger auto_recover) and a POST back to 3 completes under load.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from e2e import load as load_mod
from moe_runtime.elastic import stages
from tests.support import runtime_proc

pytestmark = pytest.mark.ray

MODEL = "synthetic://tiny?seed=0"
TOKEN = "chaos-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LENGTHS = (24, 64)
SEEDS = (1,)
Reference = dict[tuple[int, int, int | None], list[int]]


@pytest.fixture(scope="module")
def reference() -> Reference:
    return load_mod.reference_tokens(MODEL, load_mod.cases(lengths=LENGTHS, seeds=SEEDS))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[runtime_proc.RuntimeProcess]:
    log: pathlib.Path = tmp_path_factory.mktemp("chaos") / "serve.log"
    srv = runtime_proc.start(
        ["--model", MODEL, "--data-parallel-size", "3", "--max-data-parallel-size", "4"],
        log=log,
        env={"MOE_ADMIN_TOKEN": TOKEN},
    )
    yield srv
    srv.stop()


def status(url: str) -> dict[str, Any]:
    return runtime_proc.status(url, headers=AUTH)


def recoveries(st: dict[str, Any]) -> list[dict[str, Any]]:
    return [h for h in st["history"] if h["kind"] == "recovery"]


class Incident:
    """Signal rank 1's process and watch /elastic_ep/status until the runtime serves again."""

    def __init__(self, url: str, sig: signal.Signals) -> None:
        self.url = url
        st = status(url)
        assert st["data_parallel_size"] == 3, st
        (victim,) = [r for r in st["ranks"] if r["rank"] == 1]
        self.pid: int = victim["pid"]
        self.before = len(recoveries(st))
        self.sig = sig
        self.signalled = 0.0
        self.signalled_mono = 0.0
        self.seen: float | None = None  # first status showing the loss

    def __enter__(self) -> Incident:
        self.signalled, self.signalled_mono = time.time(), time.monotonic()
        os.kill(self.pid, self.sig)
        return self

    def __exit__(self, *exc: object) -> None:
        # A stopped or killed actor is the raylet's child of our server: make sure it is gone.
        if _alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)

    def wait_recovered(self, deadline_s: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            st = status(self.url)
            lost = [r for r in st["ranks"] if not r["healthy"]]
            if self.seen is None and (
                lost or st["stage"] == "Recovering" or recoveries(st)[self.before :]
            ):
                self.seen = time.time()
            done = [
                h for h in recoveries(st)[self.before :] if h["stage"] in ("Completed", "Failed")
            ]
            if done:
                return done[-1]
            time.sleep(0.05)
        raise AssertionError(f"no recovery within {deadline_s}s: {status(self.url)}")

    def report(self, rec: dict[str, Any], load: load_mod.Load) -> str:
        info = rec["recovery"]
        seen = (self.seen or 0.0) - self.signalled
        back = info["recovered_at"] - self.signalled
        # Streamed tokens from the signal until 2 s after the survivors served again.
        gap = load.longest_gap(self.signalled_mono, self.signalled_mono + back + 2.0)
        return (
            f"{self.sig.name} rank 1 (pid {self.pid}): status showed it after {seen:.2f}s, "
            f"detected after {info['detected_at'] - self.signalled:.2f}s, serving on "
            f"{rec['to']} ranks after {back:.2f}s; {info['requests_rerun']} requests re-run, "
            f"experts {info['experts_restored']}; longest gap between streamed tokens "
            f"{gap:.2f}s; "
            f"{load.summary()}"
        )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_size(url: str, size: int, deadline_s: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        st = status(url)
        if st["data_parallel_size"] == size and not st["is_scaling"]:
            return st
        time.sleep(0.2)
    raise AssertionError(f"not back at {size} ranks in {deadline_s}s: {status(url)}")


def wait_answers(load: load_mod.Load, more: int, deadline_s: float = 120.0) -> None:
    target = load.ok + more
    deadline = time.monotonic() + deadline_s
    while load.ok < target and not load.failures:
        assert time.monotonic() < deadline, f"load stalled: {load.summary()}"
        time.sleep(0.05)


def checked_load(url: str, reference: Reference) -> load_mod.Load:
    return load_mod.Load(
        lambda: url,
        model_name="tiny",
        reference=reference,
        clients=6,
        lengths=LENGTHS,
        seeds=SEEDS,
    )


def test_sigkill_of_a_rank_under_load_loses_nothing_and_grows_back(
    server: runtime_proc.RuntimeProcess, reference: Reference
) -> None:
    url = server.url
    with checked_load(url, reference) as load, runtime_proc.HealthProbe(url) as health:
        wait_answers(load, 6)
        with Incident(url, signal.SIGKILL) as incident:
            rec = incident.wait_recovered()
        wait_answers(load, 6)
        grown = wait_size(url, 3)
        done = runtime_proc.scale(url, 3, headers=AUTH)  # the operator asking for its size
        wait_answers(load, 6)
    print("\n" + incident.report(rec, load))
    assert load.failures == [], server.tail()
    assert set(health.codes) == {200}
    assert rec["stage"] == "Completed" and (rec["from"], rec["to"]) == (3, 2), rec
    assert [r["pid"] for r in rec["recovery"]["ranks_lost"]] == [incident.pid]
    assert not _alive(incident.pid)
    back = [h for h in grown["history"] if h["trigger"] == "auto_recover"][-1]
    assert (back["from"], back["to"], back["stage"]) == (2, 3, "Completed"), back
    assert [s["stage"] for s in back["stages"]] == [s.value for s in stages.SCALE_UP[:-1]]
    assert done["stage"] == "Completed" and grown["auto_recover"]["target"] is None
    assert all(r["healthy"] for r in grown["ranks"]) and len(grown["ranks"]) == 3
    assert httpx.get(f"{url}/ready").status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    assert 'moe_recoveries_total{outcome="completed"}' in metrics


def test_sigstop_of_a_rank_under_load_is_fenced_and_loses_nothing(
    server: runtime_proc.RuntimeProcess, reference: Reference
) -> None:
    url = server.url
    wait_size(url, 3)
    with checked_load(url, reference) as load, runtime_proc.HealthProbe(url) as health:
        wait_answers(load, 6)
        with Incident(url, signal.SIGSTOP) as incident:
            rec = incident.wait_recovered()
            deadline = time.monotonic() + 60
            while _alive(incident.pid):  # fenced: Ray kills the stopped process
                assert time.monotonic() < deadline, "the hung rank was not fenced"
                time.sleep(0.05)
        wait_answers(load, 6)
    print("\n" + incident.report(rec, load))
    assert load.failures == [], server.tail()
    assert set(health.codes) == {200}
    assert rec["stage"] == "Completed", rec
    (lost,) = rec["recovery"]["ranks_lost"]
    assert lost["pid"] == incident.pid and "no heartbeat answer" in lost["reason"], lost
