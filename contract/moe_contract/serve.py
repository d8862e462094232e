"""The ``moe-runtime serve`` command line the operator passes to the head (docs/RUNTIME.md).

The flags are named once, here: the runtime's parser (``moe_runtime.parser.build_parser``)
declares them with these constants, and :class:`ServeArgs` renders them. Each field of
``ServeArgs`` is named as the parser's destination of its flag (``--data-parallel-size`` ->
``data_parallel_size``), so a test parses ``ServeArgs.argv()`` with the runtime's own parser
and compares field by field (tests/unit/test_contract.py).
"""

from __future__ import annotations

import dataclasses
from typing import Final

#: The program and its subcommand.
COMMAND: Final = ("moe-runtime", "serve")

MODEL: Final = "--model"
DATA_PARALLEL_SIZE: Final = "--data-parallel-size"
#: Devices (rank actors) per data-parallel rank that shard its attention and dense layers.
TENSOR_PARALLEL_SIZE: Final = "--tensor-parallel-size"
#: Where the routed experts live at tensor-parallel size > 1: "leader" (TP rank 0 of each DP
#: rank) or "mesh" (a part of each DP rank's slots on every TP rank: EP over DP x T).
EXPERT_LAYOUT: Final = "--expert-layout"
EXPERT_LAYOUTS: Final = ("leader", "mesh")
#: Contiguous stages the decoder layers are split into, per data-parallel rank.
PIPELINE_PARALLEL_SIZE: Final = "--pipeline-parallel-size"
#: New tokens on the busiest DP rank from which a step goes through the stages as micro-batches.
PIPELINE_MICRO_BATCH_TOKENS: Final = "--pipeline-micro-batch-tokens"
#: A boolean flag (``--no-pipeline-interleave``): consecutive steps take alternate halves of
#: the sequences, a step's first stage running while the previous step is in the later ones.
PIPELINE_INTERLEAVE: Final = "--pipeline-interleave"
SERVED_MODEL_NAME: Final = "--served-model-name"
HOST: Final = "--host"
PORT: Final = "--port"
MIN_DATA_PARALLEL_SIZE: Final = "--min-data-parallel-size"
MAX_DATA_PARALLEL_SIZE: Final = "--max-data-parallel-size"
NUM_REDUNDANT_EXPERTS: Final = "--num-redundant-experts"
#: A boolean flag (``argparse.BooleanOptionalAction``): ``--eplb`` / ``--no-eplb``.
EPLB: Final = "--eplb"
EPLB_WINDOW_SIZE: Final = "--eplb-window-size"
EPLB_STEP_INTERVAL: Final = "--eplb-step-interval"
MAX_EXPERTS_PER_RANK: Final = "--max-experts-per-rank"
DEVICE: Final = "--device"
DTYPE: Final = "--dtype"
DRAIN_TIMEOUT: Final = "--drain-timeout"
MAX_QUEUED_REQUESTS: Final = "--max-queued-requests"
ADMIN_TOKEN_FILE: Final = "--admin-token-file"
WARM_SPARE_RANKS: Final = "--warm-spare-ranks"
#: A boolean flag: ``--auto-recover`` / ``--no-auto-recover``.
AUTO_RECOVER: Final = "--auto-recover"
#: Seconds a stop signal leaves requests in flight to finish before they are ended.
SHUTDOWN_TIMEOUT: Final = "--shutdown-timeout"
#: Its default: the head pod's termination grace period is this plus the time the runtime
#: takes to stop its ranks afterwards (the operator's ``HEAD_GRACE_SECONDS``).
DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 20

#: Values of ``--device``.
DEVICE_AUTO: Final = "auto"
DEVICE_CPU: Final = "cpu"
DEVICE_CUDA: Final = "cuda"
DEVICES: Final = (DEVICE_AUTO, DEVICE_CPU, DEVICE_CUDA)

#: Values of ``--dtype``: ``auto`` is the checkpoint's dtype, else bfloat16 on a GPU and
#: float32 on a CPU (the runtime decides per rank).
DTYPE_AUTO: Final = "auto"
DTYPE_BFLOAT16: Final = "bfloat16"
DTYPES: Final = (DTYPE_AUTO, "float32", DTYPE_BFLOAT16, "float16")


def negated(flag: str) -> str:
    """The ``--no-`` form of a boolean flag (what ``argparse.BooleanOptionalAction`` adds)."""
    return "--no-" + flag.removeprefix("--")


def dest(flag: str) -> str:
    """The attribute argparse stores a flag's value in (``--eplb-window-size`` ->
    ``eplb_window_size``)."""
    return flag.removeprefix("--").replace("-", "_")


def _option(flag: str, value: object) -> list[str]:
    text = str(value)
    # A value that starts with "-" would be read as an option by argparse ("expected one
    # argument"): it goes in the --flag=value form, which argparse never splits.
    return [f"{flag}={text}"] if text.startswith("-") else [flag, text]


@dataclasses.dataclass(frozen=True)
class ServeArgs:
    """What the operator tells ``moe-runtime serve``; ``argv()`` is the command line."""

    model: str
    data_parallel_size: int
    served_model_name: str
    host: str
    port: int
    min_data_parallel_size: int
    max_data_parallel_size: int
    num_redundant_experts: int
    eplb: bool
    eplb_window_size: int
    eplb_step_interval: int
    device: str
    drain_timeout: int
    max_queued_requests: int
    admin_token_file: str
    auto_recover: bool
    #: ``None``: the runtime's default (no bound).
    max_experts_per_rank: int | None = None
    #: 0 (the runtime's default) is left out.
    warm_spare_ranks: int = 0
    #: One of ``DTYPES``.
    dtype: str = DTYPE_AUTO
    #: 1 (the runtime's default) is left out, so a head of an older runtime still parses it.
    tensor_parallel_size: int = 1
    #: 1 (the runtime's default) is left out.
    pipeline_parallel_size: int = 1
    #: ``None``: the runtime's default (left out).
    pipeline_micro_batch_tokens: int | None = None
    #: ``None``: the runtime's default (left out); False: ``--no-pipeline-interleave``.
    pipeline_interleave: bool | None = None
    #: One of ``EXPERT_LAYOUTS``; ``None``: the runtime's default (left out).
    expert_layout: str | None = None
    #: Seconds; the runtime's default (``DEFAULT_SHUTDOWN_TIMEOUT_S``) is left out, so a
    #: head of an older runtime still parses the line.
    shutdown_timeout: float = float(DEFAULT_SHUTDOWN_TIMEOUT_S)

    def argv(self) -> list[str]:
        """``moe-runtime serve ...``, in a fixed order (the head's command in the RayCluster)."""
        out = [*COMMAND]
        out += _option(MODEL, self.model)
        out += _option(DATA_PARALLEL_SIZE, self.data_parallel_size)
        if self.tensor_parallel_size != 1:
            out += _option(TENSOR_PARALLEL_SIZE, self.tensor_parallel_size)
        if self.pipeline_parallel_size != 1:
            out += _option(PIPELINE_PARALLEL_SIZE, self.pipeline_parallel_size)
        if self.pipeline_micro_batch_tokens is not None:
            out += _option(PIPELINE_MICRO_BATCH_TOKENS, self.pipeline_micro_batch_tokens)
        if self.pipeline_interleave is not None:
            on = self.pipeline_interleave
            out.append(PIPELINE_INTERLEAVE if on else negated(PIPELINE_INTERLEAVE))
        if self.expert_layout is not None:
            out += _option(EXPERT_LAYOUT, self.expert_layout)
        out += _option(SERVED_MODEL_NAME, self.served_model_name)
        out += _option(HOST, self.host)
        out += _option(PORT, self.port)
        out += _option(MIN_DATA_PARALLEL_SIZE, self.min_data_parallel_size)
        out += _option(MAX_DATA_PARALLEL_SIZE, self.max_data_parallel_size)
        out += _option(NUM_REDUNDANT_EXPERTS, self.num_redundant_experts)
        out.append(EPLB if self.eplb else negated(EPLB))
        out += _option(EPLB_WINDOW_SIZE, self.eplb_window_size)
        out += _option(EPLB_STEP_INTERVAL, self.eplb_step_interval)
        if self.max_experts_per_rank is not None:
            out += _option(MAX_EXPERTS_PER_RANK, self.max_experts_per_rank)
        out += _option(DEVICE, self.device)
        out += _option(DTYPE, self.dtype)
        out += _option(DRAIN_TIMEOUT, self.drain_timeout)
        out += _option(MAX_QUEUED_REQUESTS, self.max_queued_requests)
        out += _option(ADMIN_TOKEN_FILE, self.admin_token_file)
        if self.warm_spare_ranks:
            out += _option(WARM_SPARE_RANKS, self.warm_spare_ranks)
        out.append(AUTO_RECOVER if self.auto_recover else negated(AUTO_RECOVER))
        if self.shutdown_timeout != DEFAULT_SHUTDOWN_TIMEOUT_S:
            out += _option(SHUTDOWN_TIMEOUT, self.shutdown_timeout)
        return out
