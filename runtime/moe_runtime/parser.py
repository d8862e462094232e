"""The parser of `moe-runtime` (`build_parser`): every `serve` flag, its default and check. The
flags the operator passes are named by `moe_contract.serve` (a test parses the operator's
command line with this parser); `cli` runs what it parses."""

from __future__ import annotations

import argparse
import os

from moe_contract import names
from moe_contract import serve as flags
from moe_runtime import logs

DESCRIPTION = "Command line of the runtime: `moe-runtime serve ...`."
DEFAULT_MAX_QUEUED = 1024


def build_parser() -> argparse.ArgumentParser:
    """The parser of `moe-runtime`; the `serve` flags the operator passes are named by
    `moe_contract.serve` (a test parses the operator's command line with this parser)."""
    parser = argparse.ArgumentParser(prog="moe-runtime", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument(
        flags.MODEL,
        required=True,
        help="synthetic://NAME?seed=S or a directory holding a Mixtral-format checkpoint",
    )
    serve.add_argument(flags.DATA_PARALLEL_SIZE, type=_positive, required=True, help="DP ranks")
    serve.add_argument(
        flags.TENSOR_PARALLEL_SIZE,
        type=_positive,
        default=1,
        help="rank actors (devices) per DP rank sharding attention, dense MLPs and the "
        "vocabulary (docs/TENSOR-PARALLEL.md)",
    )
    serve.add_argument(
        flags.EXPERT_LAYOUT,
        choices=flags.EXPERT_LAYOUTS,
        default=None,
        help="at T > 1, where the routed experts live: on each DP rank's TP rank 0 (leader), "
        "or a part of its expert slots on each of its T devices, expert parallelism over "
        "DP x T (mesh; at P > 1 per stage; docs/TENSOR-PARALLEL.md)",
    )
    serve.add_argument(
        flags.PIPELINE_PARALLEL_SIZE,
        type=_positive,
        default=1,
        help="contiguous stages of the decoder layers per DP rank",
    )
    serve.add_argument(
        flags.PIPELINE_MICRO_BATCH_TOKENS,
        type=_non_negative,
        default=None,
        help="at P > 1, a step whose busiest DP rank has at least this many new tokens (a "
        "prefill) goes through the stages as P micro-batches, the stages working at once "
        "(default 256); 0: every step goes whole (docs/PIPELINE-PARALLEL.md)",
    )
    serve.add_argument(
        flags.PIPELINE_INTERLEAVE,
        action=argparse.BooleanOptionalAction,
        default=None,  # on: `cli` reads "not False" (the operator leaves it out when unset)
        help="at P > 1, consecutive steps take alternate halves of the running sequences and "
        "a step's stage 0 runs while the previous step is in the later stages (vLLM's "
        "virtual engines; steps by plain Ray calls, not the step graph; default on; "
        "docs/PIPELINE-PARALLEL.md)",
    )
    serve.add_argument(
        flags.NUM_REDUNDANT_EXPERTS,
        type=_non_negative,
        default=0,
        help="extra expert slots; raised to the next value that fills every rank equally",
    )
    serve.add_argument(
        flags.MAX_DATA_PARALLEL_SIZE,
        type=_positive,
        default=None,
        help="rank slots a local Ray instance offers (default: max(8, DP))",
    )
    serve.add_argument(flags.SERVED_MODEL_NAME, default=None, help="model name in the API")
    serve.add_argument(flags.HOST, default="127.0.0.1")
    serve.add_argument(flags.PORT, type=int, default=names.RUNTIME_PORT)
    serve.add_argument("--executor", choices=("ray", "local"), default="ray")
    serve.add_argument("--max-num-seqs", type=_positive, default=64, help="sequences per rank")
    serve.add_argument(
        "--max-tokens-per-step",
        type=_positive,
        default=2048,
        help="token budget of one rank in one step (bounds prefill chunks)",
    )
    serve.add_argument(
        flags.MAX_QUEUED_REQUESTS,
        type=_non_negative,
        default=DEFAULT_MAX_QUEUED,
        help="requests that may wait for a sequence slot; more get 429 with Retry-After "
        "(never while a resize runs); 0 = no bound",
    )
    serve.add_argument(
        "--kv-cache-bytes",
        type=_non_negative,
        default=0,
        help="KV cache budget of one device of a rank in bytes (a rank at "
        "--tensor-parallel-size T is T devices, each caching its heads); requests wait in the "
        "queue while no rank has room for prompt + max_tokens; 0 = auto (--kv-cache-fraction)",
    )
    serve.add_argument(
        "--kv-cache-fraction",
        type=_positive_float,
        default=0.25,
        help="auto KV budget: this fraction of the host's available memory shared by the "
        "ranks on it (CPU), or of the GPU's free memory less the weights and a margin",
    )
    serve.add_argument(
        flags.SHUTDOWN_TIMEOUT,
        type=_non_negative_float,
        default=float(flags.DEFAULT_SHUTDOWN_TIMEOUT_S),
        help="seconds a stop signal (SIGTERM, SIGINT) leaves the requests in flight to "
        "finish, new connections refused at once; those still running then are ended and the "
        "ranks stop; 0 = end them at once",
    )
    serve.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="serve token ids only (no tokenizer: a text prompt gets 400), as vLLM's flag",
    )
    serve.add_argument(
        flags.DTYPE,
        choices=flags.DTYPES,
        default=flags.DTYPE_AUTO,
        help="serving dtype; auto: the checkpoint's (config.json dtype / torch_dtype), else "
        "bfloat16 on GPUs and float32 on CPUs (each rank by its device)",
    )
    serve.add_argument(
        flags.DEVICE,
        choices=flags.DEVICES,
        default=flags.DEVICE_AUTO,
        help="where ranks run: cuda (one GPU per rank; waits for GPU nodes to join), cpu, or "
        "auto (cuda when the Ray cluster has GPUs at start; the operator always says which)",
    )
    serve.add_argument(
        "--step-mode",
        choices=("compiled", "remote"),
        default=None,
        help="how the ray executor runs a step: a Ray compiled graph (default; env "
        "MOE_STEP_MODE; torn down after MOE_STEP_GRAPH_PARK_SECONDS, 2 s, without a step, "
        "since its actors poll for input) or plain actor calls (slower steps)",
    )
    elastic = serve.add_argument_group("elastic expert parallelism")
    elastic.add_argument(
        flags.MIN_DATA_PARALLEL_SIZE,
        type=_positive,
        default=1,
        help="smallest size a resize may ask",
    )
    elastic.add_argument(
        flags.MAX_EXPERTS_PER_RANK,
        type=_positive,
        default=None,
        help="expert slots one rank can hold; sizes that would need more are refused",
    )
    elastic.add_argument(
        "--weight-source",
        choices=("peer", "storage"),
        default="peer",
        help="where new ranks get non-expert weights on scale-up",
    )
    elastic.add_argument(
        flags.EPLB, action=argparse.BooleanOptionalAction, default=True, help="dynamic EPLB"
    )
    elastic.add_argument(flags.EPLB_WINDOW_SIZE, type=_positive, default=1000)
    elastic.add_argument(flags.EPLB_STEP_INTERVAL, type=_positive, default=3000)
    elastic.add_argument(
        flags.AUTO_RECOVER,
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after a rank was lost and the runtime shrank around it, grow back to the size "
        "before the failure when rank capacity returns (MoEDeployment faultTolerance.autoRecover)",
    )
    elastic.add_argument(
        "--rank-hang-timeout",
        type=_positive_float,
        default=3.0,
        help="seconds without a heartbeat answer before a rank counts as hung and is fenced",
    )
    elastic.add_argument(
        flags.WARM_SPARE_RANKS,
        type=_non_negative,
        default=0,
        help="rank workers kept started beside the active ones (non-expert weights loaded, "
        "warmed up, in standby groups), so a grow by up to this many skips Standby; each takes "
        "a rank slot (moe_rank) of its own (MoEDeployment elastic.warmSpareRanks)",
    )
    elastic.add_argument(
        "--rank-pool",
        type=_non_negative,
        default=0,
        help="rank processes kept started beside the ranks with no weights (Python, Ray, "
        "torch and the runtime imported), so a grow the warm spares do not cover takes them "
        "instead of starting processes; refilled in the background after a grow; each takes a "
        "rank slot (moe_rank) of its own",
    )
    elastic.add_argument(
        flags.DRAIN_TIMEOUT,
        type=_non_negative,
        default=0,
        help="seconds a shrink lets sequences on departing ranks finish before it migrates the "
        "rest, when the request gives no drain_timeout (0 = migrate at once)",
    )
    elastic.add_argument(
        "--admin-token",
        default=None,
        help="bearer token of the admin routes (default: $MOE_ADMIN_TOKEN; none = open)",
    )
    elastic.add_argument(
        flags.ADMIN_TOKEN_FILE,
        default=None,
        help="read the admin token from this file, again whenever it changes (a mounted "
        "Secret; default: $MOE_ADMIN_TOKEN_FILE)",
    )
    serve.add_argument("--log-level", default="INFO")
    serve.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=os.environ.get(logs.FORMAT_ENV, "text"),
        help="json: one JSON object per line with deployment, pod, rank, stage and resize_id "
        f"(default: ${logs.FORMAT_ENV}, else text)",
    )
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
