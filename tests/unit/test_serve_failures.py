"""`moe-runtime serve` that cannot start says why in one line: on stderr, in the container's
termination message (/dev/termination-log, which the kubelet shows in the pod's status), and
by a non-zero exit status."""

from __future__ import annotations

import json
import pathlib

import pytest
import safetensors.torch
import torch

from moe_contract import loading
from moe_runtime import cli
from tests.support import checkpoints

pytestmark = pytest.mark.usefixtures("keep_sigterm")  # tests/unit/conftest.py


def _serve(model: str) -> int:
    argv = ["serve", "--model", model, "--data-parallel-size", "1", "--executor", "local"]
    argv += ["--port", "0"]  # the loading server listens while the model loads
    return cli.serve(cli.build_parser().parse_args(argv))


def _wrong_shape(path: pathlib.Path) -> None:
    """A checkpoint whose every tensor is listed but one has the wrong shape: it opens, and
    fails when a rank loads it."""
    checkpoints.build(path)
    tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(7)
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _refused_family(path: pathlib.Path) -> None:
    checkpoints.build(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))


CASES = [
    pytest.param(lambda p: None, "no such checkpoint directory", id="bad-path"),
    pytest.param(lambda p: p.mkdir(), "needs config.json", id="no-config-json"),
    pytest.param(_refused_family, "model_type 'llama' is not supported", id="refused-model-type"),
    pytest.param(_wrong_shape, "model.norm.weight", id="load-error"),
]


@pytest.mark.parametrize(("make", "reason"), CASES)
def test_a_serve_that_cannot_start_says_why(
    make: object,
    reason: str,
    tmp_path: pathlib.Path,
    termination_log: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = tmp_path / "model"
    make(model)  # type: ignore[operator]
    assert _serve(str(model)) == 1
    message = termination_log.read_text()
    assert reason in message and str(model) in message
    assert message.count("\n") == 1 and len(message) <= loading.MAX_TERMINATION_MESSAGE + 1
    assert f"moe-runtime serve: {message.strip()}" in capsys.readouterr().err


def test_no_termination_log_is_created_outside_a_pod(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "absent"
    monkeypatch.setenv(loading.TERMINATION_LOG_ENV, str(path))
    assert _serve(str(tmp_path / "nowhere")) == 1
    assert not path.exists()


#: What Ray 2.60 says of a rank actor whose process the kernel killed (`ActorDiedError` with
#: the raylet's exit detail), cut to its telling lines.
_KILLED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: RankActor\n"
    "\tpid: 113\n\tip: 10.244.0.8\nThe actor is dead because its worker process has died. "
    "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a "
    "connection error code 2. End of file. Some common causes include: (1) the process was "
    "killed by the OOM killer due to high memory usage, (2) ray stop --force was called"
)


@pytest.mark.parametrize(
    ("text", "memory"),
    [(_KILLED, True), ("The actor died because of an error raised in its creation task", False)],
)
def test_a_rank_that_died_is_one_line_naming_memory_when_ray_does(text: str, memory: bool) -> None:
    """On the real node a rank in a worker pod whose memory limit is below what it needs was
    reported as only "The actor died unexpectedly before finishing this task."; the line the
    head's termination message carries now says what to change."""
    from moe_runtime.executor import ray_calls

    line = ray_calls.death(RuntimeError(text))
    assert "\n" not in line and line.startswith(text.splitlines()[0])
    assert ("out of memory" in line and "workerResources" in line) is memory
