"""A non-Mixtral family on the real node: the DeepSeek-V3 shape (`synthetic://deepseek-tiny`:
multi-head latent attention, a dense first layer, shared experts, grouped sigmoid routing)
served by a MoEDeployment with `spec.model.dtype: float32`, resized 2→3 under checked load,
and answering the OpenAI chat route through the `openai` client.

The checkpoint families of Hugging Face (Qwen, OLMoE, DeepSeek, gpt-oss) are proven equal to
transformers in the integration tier (`tests/integration/test_families_server.py`), on the
same runtime; a checkpoint directory inside the image or on a claim is what a real deployment
would point at, and a synthetic model of the DeepSeek shape needs neither. Every completion
here is checked token for token against single-process generation of the same model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from e2e import kube
from e2e import load as load_mod
from e2e.cluster import conftest

pytestmark = pytest.mark.cluster

NAME = "deepseek"
MODEL = "synthetic://deepseek-tiny?seed=0"
READY_TIMEOUT_S = 420.0
RESIZE_TIMEOUT_S = 420.0
LENGTHS = (8, 24, 48)


def _manifest() -> dict[str, Any]:
    model = {"source": MODEL, "servedModelName": NAME, "dtype": "float32"}
    return conftest.manifest(NAME, model)


@pytest.fixture(scope="module")
def endpoint(node: kube.Kubectl, namespace: str) -> Iterator[Callable[[], str | None]]:
    yield from conftest.service_url(node, namespace, NAME)


@pytest.fixture(scope="module")
def dep(node: kube.Kubectl, namespace: str, endpoint: Callable[[], str | None]) -> kube.Deployment:
    return conftest.apply(
        node, namespace, _manifest(), endpoint=endpoint, ready=lambda d: d.serving(2),
        what=f"{MODEL} Serving at DP=2", timeout_s=READY_TIMEOUT_S, tag="families",
    )  # fmt: skip


@pytest.fixture(scope="module")
def load(dep: kube.Deployment) -> Iterator[load_mod.Load]:
    with conftest.model_load(dep, model=MODEL, lengths=LENGTHS, tag="families") as lg:
        yield lg


def test_serves_the_deepseek_shape_at_two_ranks(dep: kube.Deployment, load: load_mod.Load) -> None:
    status = dep.runtime_status()
    assert status["data_parallel_size"] == 2
    head = dep.kubectl("logs", "-n", dep.namespace, "-l", "ray.io/node-type=head", "--tail=-1")
    assert "(deepseek_v3, float32)" in head.stdout
    assert not load.failures, load.failures[:3]


def test_grow_to_three_under_load(dep: kube.Deployment, load: load_mod.Load) -> None:
    before = load.ok
    dep.kubectl("scale", "moed", NAME, "-n", dep.namespace, "--replicas=3")
    kube.wait_for(lambda: dep.serving(3), timeout_s=RESIZE_TIMEOUT_S, what="DP=3 Serving")
    kube.wait_for(lambda: load.ok >= before + 8 or load.failed, timeout_s=180, what="answers at 3")
    records = [r for r in dep.runtime_status()["history"] if (r["from"], r["to"]) == (2, 3)]
    assert records and records[-1]["stage"] == "Completed", records
    assert not load.failures, load.failures[:3]


def test_chat_through_the_openai_client(dep: kube.Deployment) -> None:
    url = dep.endpoint()
    assert url is not None
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    messages: Any = [{"role": "user", "content": "hello"}]
    plain = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0
    )
    streamed = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert plain.choices[0].message.content == text
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert plain.usage is not None and plain.usage.prompt_tokens > 0


def test_no_request_failed(load: load_mod.Load) -> None:
    assert load.ok > 0 and not load.failures, load.summary()
