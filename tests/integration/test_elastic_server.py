"""Issue acceptance: live resizes of `moe-runtime serve` (Ray ranks, compiled step graph).

One server for the module, DP=2 on synthetic://tiny. Under continuous load of 8 clients, the
resize sequence 2→4→3→1→2 through POST /scale_elastic_ep completes with no failed request, no
5xx, /health always 200, and every answer token-identical to single-process generation.

Its KV cache is tight (a context of 256 positions and the smallest budget, one context a
rank: one long generation, or a few short ones, at a time), so the load floods it: requests
wait in the queue for KV room before and through every resize, and a shrink's migrated
sequences wait for room on the survivors (the budget follows the rank count).
"""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from e2e import load as load_mod
from moe_runtime.elastic import stages
from tests.support import runtime_proc

pytestmark = pytest.mark.ray

MODEL = "synthetic://tiny?seed=0&max_position_embeddings=256"
#: The smallest KV budget (floored at one context): 256 positions a rank.
KV_CACHE_BYTES = 256 * 1024
TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LONG = 160  # long enough to still be decoding when a shrink reaches Migrating, under load
LENGTHS = (8, 16, 24)  # of the checked load (greedy and seeded, streamed or not)
Reference = dict[tuple[int, int, int | None], list[int]]


@pytest.fixture(scope="module")
def reference() -> Reference:
    return load_mod.reference_tokens(MODEL, load_mod.cases(lengths=(*LENGTHS, LONG), seeds=(1,)))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[runtime_proc.RuntimeProcess]:
    log: pathlib.Path = tmp_path_factory.mktemp("elastic") / "serve.log"
    srv = runtime_proc.start(
        ["--model", MODEL, "--data-parallel-size", "2", "--max-data-parallel-size", "4"]
        + ["--eplb-step-interval", "50", "--eplb-window-size", "50"]
        + ["--kv-cache-bytes", str(KV_CACHE_BYTES)],
        log=log,
        env={"MOE_ADMIN_TOKEN": TOKEN, "MOE_ENABLE_TEST_HOOKS": "1"},
    )
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def starts_at_two(server: runtime_proc.RuntimeProcess) -> None:
    """Every test starts serving at DP 2, the server's size, whatever ran before it."""
    if status(server.url)["data_parallel_size"] != 2:
        scale(server.url, 2)


UPS = 'moe_resizes_total{direction="up",outcome="completed"}'
BLACKOUTS = "moe_resize_blackout_seconds_count"


def counter(url: str, series: str) -> float:
    """The value of one series of /metrics (0 before it exists)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def complete(client: httpx.Client, prompt: int, n: int) -> httpx.Response:
    return client.post("/v1/completions", json=load_mod.Case(prompt, n).body("tiny"), timeout=300)


HealthProbe = runtime_proc.HealthProbe


def scale(url: str, to: int) -> dict[str, Any]:
    return runtime_proc.scale(url, to, headers=AUTH)


def status(url: str) -> dict[str, Any]:
    return runtime_proc.status(url, headers=AUTH)


def test_resize_sequence_under_load(
    server: runtime_proc.RuntimeProcess, reference: Reference
) -> None:
    earlier = len(status(server.url)["history"])
    ups, blackouts = counter(server.url, UPS), counter(server.url, BLACKOUTS)
    traffic = load_mod.Load(
        lambda: server.url,
        model_name="tiny",
        reference=reference,
        clients=8,
        lengths=LENGTHS,
        seeds=(1,),
    )
    with traffic, HealthProbe(server.url) as health:
        for to in (4, 3, 1, 2):
            assert scale(server.url, to)["stage"] == "Completed"
        deadline = time.monotonic() + 60
        while traffic.ok < 50 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert traffic.failures == [], server.tail()
    assert traffic.ok >= 50
    assert health.codes and set(health.codes) == {200}
    st = status(server.url)
    assert st["data_parallel_size"] == 2 and st["target_data_parallel_size"] == 2
    history = st["history"][earlier:]
    assert [(h["from"], h["to"]) for h in history] == [(2, 4), (4, 3), (3, 1), (1, 2)]
    for h in history:
        want = stages.SCALE_UP if h["to"] > h["from"] else stages.SCALE_DOWN
        assert [s["stage"] for s in h["stages"]] == [s.value for s in want[:-1]]
        assert h["stage"] == "Completed"
        assert all(s["duration_s"] is not None and s["duration_s"] >= 0 for s in h["stages"])
    assert history[0]["bytes_moved"]["non_expert"] > 0
    assert history[0]["bytes_moved"]["expert"] > 0
    assert sorted(r["rank"] for r in st["ranks"] if r["active"]) == [0, 1]
    assert all(r["healthy"] for r in st["ranks"])
    assert counter(server.url, UPS) == ups + 2
    assert counter(server.url, BLACKOUTS) == blackouts + 4
    # the ranks' own log lines (with their rank context) reach the server's output
    ranks_log = [line for line in server.tail(2_000_000).splitlines() if "RankActor pid=" in line]
    assert any("moe_runtime.rank.slots: staged" in line and "label=" in line for line in ranks_log)


def test_shrink_with_long_generations_on_departing_ranks(
    server: runtime_proc.RuntimeProcess, reference: Reference
) -> None:
    scale(server.url, 4)
    results: dict[int, httpx.Response] = {}

    def run(p: int) -> None:
        with httpx.Client(base_url=server.url) as client:
            results[p] = complete(client, p, LONG)

    threads = [threading.Thread(target=run, args=(p,)) for p in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until one long generation decodes on every rank
        metrics = httpx.get(f"{server.url}/metrics").text  # (the rest wait for KV room)
        if "moe_requests_running 4.0" in metrics and "moe_requests_waiting 4.0" in metrics:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("4 long generations running and 4 waiting for KV room: not seen")
    done = scale(server.url, 2)
    for t in threads:
        t.join(timeout=300)
    assert {p: r.json()["choices"][0]["token_ids"] for p, r in results.items()} == {
        p: reference[(p, LONG, None)] for p in range(8)
    }
    last = status(server.url)["history"][-1]
    assert last["resize_id"] == done["resize_id"]
    assert last["sequences_migrated"] > 0
    assert len(last["freed"]) == 2


def test_admin_rules(server: runtime_proc.RuntimeProcess) -> None:
    url = server.url
    body = {"new_data_parallel_size": 3}
    assert httpx.post(f"{url}/scale_elastic_ep", json=body).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(f"{url}/scale_elastic_ep", json=body, headers=wrong).status_code == 401
    assert httpx.get(f"{url}/elastic_ep/status").status_code == 401
    for bad in ({"new_data_parallel_size": 0}, {"new_data_parallel_size": "x"}, {}):
        r = httpx.post(f"{url}/scale_elastic_ep", json=bad, headers=AUTH)
        assert r.status_code in (400, 422) and "error" in r.json()
    r = httpx.post(f"{url}/scale_elastic_ep", json={"new_data_parallel_size": 9}, headers=AUTH)
    assert r.status_code == 400 and "outside the allowed range [1, 4]" in r.text
    first = httpx.post(f"{url}/scale_elastic_ep", json=body, headers=AUTH)
    assert first.status_code == 202
    again = httpx.post(f"{url}/scale_elastic_ep", json=body, headers=AUTH)
    assert again.status_code == 202 and again.json()["resize_id"] == first.json()["resize_id"]
    other = httpx.post(f"{url}/scale_elastic_ep", json={"new_data_parallel_size": 4}, headers=AUTH)
    assert other.status_code == 409
    scale(url, 3)  # waits for the running one
    assert httpx.post(f"{url}/is_scaling_elastic_ep", headers=AUTH).json() == {
        "is_scaling_elastic_ep": False
    }
    scale(url, 2)


def test_failure_in_transferring_keeps_serving(
    server: runtime_proc.RuntimeProcess, reference: Reference
) -> None:
    url = server.url
    r = httpx.post(f"{url}/elastic_ep/inject_failure", json={"stage": "Transferring"}, headers=AUTH)
    assert r.status_code == 200
    r = httpx.post(
        f"{url}/scale_elastic_ep?wait=true",
        json={"new_data_parallel_size": 4},
        headers=AUTH,
        timeout=600,
    )
    assert r.status_code == 500 and "Transferring failed" in r.json()["error"]["message"]
    st = status(url)
    assert st["stage"] == "Failed" and st["data_parallel_size"] == 2
    assert len(st["ranks"]) == 2  # the standby ranks were released
    with httpx.Client(base_url=url) as client:
        got = complete(client, 5, 16).json()["choices"][0]["token_ids"]
    assert got == reference[(5, 16, None)]
    assert scale(url, 3)["stage"] == "Completed"
    scale(url, 2)
