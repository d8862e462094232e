"""Shared by the integration tests of `serve` with more than one device per DP rank
(tests/integration/test_tp_serve.py at TP 2, test_pp_serve.py at PP 2, test_mesh_serve.py at
TP 2 x PP 2): one server per
family on the tests' Ray instance, transformers' greedy answers, checked answers and load, and
a live resize under load (`resize_under_load`) and a process of a DP rank signalled under load
until the deployment is back at its size."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import torch
import transformers
from prometheus_client import parser as prometheus_parser

from e2e import load as load_mod
from tests.support import hf_families, polling, runtime_proc

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = tuple(range(6))
LENGTHS = (6, 12)
Reference = dict[tuple[int, int, int | None], list[int]]


@dataclasses.dataclass
class Served:
    family: str
    server: runtime_proc.RuntimeProcess
    reference: Reference
    #: the data-parallel size it was started at
    size: int = 2


def reference(model: transformers.PreTrainedModel) -> Reference:
    """transformers' greedy answer to every (prompt, length) case."""
    out: Reference = {}
    for p in PROMPTS:
        greedy = hf_families.greedy(model, load_mod.PROMPTS[p], max(LENGTHS))
        for n in LENGTHS:
            out[(p, n, None)] = greedy[:n]
    return out


def serve(
    root: pathlib.Path,
    family: str,
    ray_address: str,
    *,
    size: int,
    mesh: list[str],
    env: dict[str, str] | None = None,
) -> Iterator[Served]:
    """`serve --model CKPT --data-parallel-size SIZE MESH --dtype float32` on a fresh tiny
    checkpoint of `family` under `root`, on the tests' Ray instance, with `env` (a generator
    for a fixture: stopped after its yield)."""
    torch.set_num_threads(1)
    model = hf_families.build(family)
    path = hf_families.save(model, root / "ckpt")
    args = ["--model", str(path), "--data-parallel-size", str(size), *mesh]
    args += ["--dtype", "float32", "--served-model-name", family]
    server, ref = runtime_proc.start_while(
        args,
        lambda: reference(model),
        log=root / "serve.log",
        env={"MOE_ADMIN_TOKEN": TOKEN, "RAY_ADDRESS": ray_address, **(env or {})},
    )
    try:
        yield Served(family, server, ref, size)
    finally:
        server.stop()


def status(s: Served) -> dict[str, Any]:
    return runtime_proc.status(s.server.url, headers=AUTH)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` (with `labels`) the server at `url` exports now (0 when
    it exports none)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def serving(s: Served) -> list[dict[str, Any]]:
    """The active DP ranks of the status."""
    return [r for r in status(s)["ranks"] if r["rank"] is not None and r["active"]]


def assert_mesh(s: Served, size: int, pids: str, count: int = 1) -> list[dict[str, Any]]:
    """`size` DP ranks serve, each a leader and `count` live processes of its own listed in
    `pids` (`tp_pids`: its TP followers, `pp_pids`: its pipeline stages after the first)."""
    ranks = serving(s)
    assert len(ranks) == size, ranks
    for r in ranks:
        assert len(r[pids]) == count and r["pid"] not in r[pids], r
        for pid in r[pids]:
            os.kill(pid, 0)  # alive
    return ranks


def _answer(client: httpx.Client, family: str, case: load_mod.Case) -> list[int]:
    body = dict(case.body(family), stream=False)
    r = client.post("/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["choices"][0]["token_ids"]
    return tokens


def check_answers(s: Served) -> None:
    """Every greedy case, six at a time, equals transformers' answer."""
    cases = [load_mod.Case(p, n, None) for p in PROMPTS for n in LENGTHS]
    with (
        httpx.Client(base_url=s.server.url) as client,
        concurrent.futures.ThreadPoolExecutor(6) as pool,
    ):
        got = list(pool.map(lambda c: _answer(client, s.family, c), cases))
    wrong = [
        (c.key, g, s.reference[c.key])
        for c, g in zip(cases, got, strict=True)
        if g != s.reference[c.key]
    ]
    assert not wrong, f"{s.family}: {len(wrong)} answers differ from transformers: {wrong[:3]}"


def load(s: Served) -> load_mod.Load:
    """Four checked clients (greedy, streamed or not)."""
    return load_mod.Load(
        lambda: s.server.url,
        model_name=s.family,
        reference=s.reference,
        clients=4,
        lengths=LENGTHS,
        seeds=(),
        prompts=PROMPTS,
    )


def resize_under_load(s: Served, size: int) -> dict[str, Any]:
    """A live resize to `size` under `load`: it completes, no request fails and some are
    answered during it. Returns the resize's final status."""
    traffic = load(s)
    with traffic:
        done = runtime_proc.scale(s.server.url, size, headers=AUTH)
    assert done["stage"] == "Completed", done
    assert not traffic.failures, traffic.failures[:3]
    assert traffic.ok > 0, traffic.summary()
    return done


@dataclasses.dataclass
class Recovered:
    #: the recoveries the history gained
    recoveries: list[dict[str, Any]]
    #: seconds from the signal until the victim's DP rank was out of the serving ones
    out_after: float | None


def signal_under_load(
    s: Served, victim: dict[str, Any], pid: int, sig: signal.Signals = signal.SIGKILL
) -> Recovered:
    """`sig` to `pid` (a process of DP rank `victim`) once the load has answers; returns when
    the recovery took that DP rank out and the deployment is back at its size, idle. No
    request of the load failed."""
    size = len(serving(s))
    before = len(status(s)["history"])
    traffic = load(s)
    with traffic:
        polling.poll(lambda: traffic.ok >= 4, traffic.summary, 60, every=0.05)
        os.kill(pid, sig)
        signalled = time.monotonic()
        seen: dict[str, Any] = {"out_after": None, "recoveries": []}

        def back() -> bool:
            st = status(s)
            seen["recoveries"] = [h for h in st["history"][before:] if h.get("recovery")]
            pids = {r["pid"] for r in serving(s)}
            if seen["out_after"] is None and victim["pid"] not in pids:
                seen["out_after"] = time.monotonic() - signalled
            return bool(
                seen["recoveries"]
                and victim["pid"] not in pids
                and st["data_parallel_size"] == size
                and not st["is_scaling"]
            )

        polling.poll(back, lambda: (status(s), s.server.tail()), 180, every=0.2)
    assert not traffic.failures, traffic.failures[:3]
    assert traffic.ok > 0, traffic.summary()
    lost = [lost for h in seen["recoveries"] for lost in h["recovery"]["ranks_lost"]]
    assert [r["pid"] for r in lost] == [victim["pid"]], seen["recoveries"]
    return Recovered(seen["recoveries"], seen["out_after"])
