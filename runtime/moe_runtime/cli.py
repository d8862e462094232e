"""Command line of the runtime: `moe-runtime serve ...`.

`serve` joins the Ray cluster at RAY_ADDRESS (or starts a local one on 127.0.0.1), starts one
rank per DP rank with an identity expert placement, the engine and the HTTP server. Ctrl-C or
SIGTERM stops it cleanly: server, engine, executor, and the Ray instance it started.
`build(args)` makes the same serving process without the HTTP server (tests drive its app).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
import types
from typing import Any

import fastapi
import torch
import uvicorn

from moe_contract import serve as flags
from moe_runtime import logs, server, termination
from moe_runtime import metrics as metrics_mod
from moe_runtime.elastic import admin as elastic_admin
from moe_runtime.elastic import coordinator as elastic_coordinator
from moe_runtime.elastic import service as elastic_service
from moe_runtime.elastic import serving as elastic_serving
from moe_runtime.engine import core, seam
from moe_runtime.eplb import policy
from moe_runtime.model import config as config_mod
from moe_runtime.model import kv as kv_mod
from moe_runtime.model import kv_budget, pipeline, tp_shard
from moe_runtime.model import source as source_mod
from moe_runtime.model import tokenizer as tokenizer_mod
from moe_runtime.parser import DEFAULT_MAX_QUEUED as DEFAULT_MAX_QUEUED  # re-exported
from moe_runtime.parser import build_parser
from moe_runtime.rank import hooks as hooks_mod
from moe_runtime.server import loading as loading_server

log = logging.getLogger("moe_runtime.cli")

#: The running resize, for the JSON log lines (``--log-format json``).
RESIZE_CONTEXT = logs.ResizeContext()


def _kv_budget(
    args: argparse.Namespace, cfg: config_mod.ModelConfig, dtype: str, num_physical: int
) -> kv_budget.KVBudget:
    """What a rank's KV cache may take at any size: `--kv-cache-bytes`, else measured now."""
    cuda = args.device == flags.DEVICE_CUDA or (
        args.device == flags.DEVICE_AUTO and torch.cuda.is_available()
    )
    return kv_budget.KVBudget.measure(
        cfg,
        kv_mod.serving_dtype(dtype, cuda=cuda),
        budget_bytes=args.kv_cache_bytes or None,
        fraction=args.kv_cache_fraction,
        cuda=cuda,
        num_physical=num_physical,
        tp_size=args.tensor_parallel_size,
        pp_size=args.pipeline_parallel_size,
        expert_parts=args.tensor_parallel_size if expert_layout(args) == "mesh" else 1,
    )


def expert_layout(args: argparse.Namespace) -> str:
    """Where the routed experts live (`--expert-layout`; default "leader")."""
    return str(args.expert_layout or "leader")


def _unsupported_mesh(args: argparse.Namespace, cfg: config_mod.ModelConfig) -> str | None:
    """Why this runtime cannot serve the asked mesh of `cfg`, or None
    (docs/TENSOR-PARALLEL.md, docs/PIPELINE-PARALLEL.md): a tensor-parallel size must shard
    the model (`tp_shard.plan`, which names the field) and needs Ray ranks; so do pipeline
    stages (`_unsupported_pipeline`)."""
    size = args.tensor_parallel_size
    if size < 1:
        return f"{flags.TENSOR_PARALLEL_SIZE} {size}: must be >= 1"
    if size > 1:
        if args.executor != "ray":
            return f"{flags.TENSOR_PARALLEL_SIZE} {size} needs the Ray executor (--executor ray)"
        try:
            tp_shard.plan(cfg, rank=0, size=size)
        except ValueError as exc:
            return f"{flags.TENSOR_PARALLEL_SIZE} {size} does not fit this model: {exc}"
    if expert_layout(args) == "mesh" and size == 1:
        return f"{flags.EXPERT_LAYOUT} mesh needs {flags.TENSOR_PARALLEL_SIZE} > 1"
    if args.pipeline_parallel_size != 1:
        return _unsupported_pipeline(args, cfg)
    return None


def _unsupported_pipeline(args: argparse.Namespace, cfg: config_mod.ModelConfig) -> str | None:
    """Why pipeline stages at `--pipeline-parallel-size` P != 1 cannot serve, or None: P must
    fit the model's layers (`pipeline.plan`) and needs the Ray executor. Everything elastic
    serves at any P (warm spares and the rank pool are whole DP ranks of T x P actors)."""
    size = args.pipeline_parallel_size
    what = f"{flags.PIPELINE_PARALLEL_SIZE} {size}"
    if size < 1:
        return f"{what}: must be >= 1"
    if args.executor != "ray":
        return f"{what} needs the Ray executor (--executor ray)"
    try:
        pipeline.plan(cfg, stage=0, size=size)
    except ValueError as exc:
        return f"{what} does not fit this model: {exc}"
    return None


def _raise_exit(signum: int, frame: types.FrameType | None) -> None:
    raise SystemExit(128 + signum)


@dataclasses.dataclass
class Runtime:
    """A serving process without its HTTP server: `app` serves it; `close()` stops it all."""

    name: str = ""
    app: fastapi.FastAPI | None = None
    engine: core.Engine | None = None
    executor: Any = None
    elastic: elastic_service.ElasticService | None = None
    cluster: Any = None
    owns_ray: bool = False

    def close(self) -> None:
        if self.elastic is not None:
            self.elastic.close()
        _shutdown(self.engine, self.executor, self.cluster, owns_ray=self.owns_ray)


def build(
    args: argparse.Namespace,
    *,
    src: source_mod.ModelSource | None = None,
    tokens: elastic_admin.TokenSource | None = None,
    runtime: Runtime | None = None,
) -> Runtime:
    """Ranks, engine, elasticity and app of `serve` (the engine started), built into `runtime`
    (a new one by default: `serve` passes its own, whose executor it asks for load progress
    while this runs); on failure what was started is stopped before the error is raised."""
    runtime = Runtime() if runtime is None else runtime
    try:
        _build_into(runtime, args, src=src, tokens=tokens)
    except BaseException:
        runtime.close()
        raise
    return runtime


def _build_into(
    runtime: Runtime,
    args: argparse.Namespace,
    *,
    src: source_mod.ModelSource | None,
    tokens: elastic_admin.TokenSource | None,
) -> None:
    if src is None:
        src = source_mod.open_source(args.model)
    if tokens is None:
        tokens = elastic_admin.token_source(
            token=args.admin_token, token_file=args.admin_token_file
        )
    cfg = src.config
    unsupported = _unsupported_mesh(args, cfg)
    if unsupported:
        raise ValueError(unsupported)
    num_ranks = args.data_parallel_size
    # the mesh layout holds an equal part of each DP rank's slots on each of its T devices
    multiple = args.tensor_parallel_size if expert_layout(args) == "mesh" else 1
    num_physical = policy.num_physical_for(
        cfg.num_experts, num_ranks * multiple, args.num_redundant_experts
    )
    if num_physical != cfg.num_experts + args.num_redundant_experts:
        log.info(
            "serve: %d redundant experts (asked %d) so %d ranks hold %d slots each",
            num_physical - cfg.num_experts,
            args.num_redundant_experts,
            num_ranks,
            num_physical // num_ranks,
        )
    placement = policy.identity(cfg.num_moe_layers, cfg.num_experts, num_physical, num_ranks)
    dtype = args.dtype if args.dtype != flags.DTYPE_AUTO else (cfg.dtype or flags.DTYPE_AUTO)
    runtime.name = args.served_model_name or _default_name(args.model)
    rank_hooks = hooks_mod.from_env()  # none but in tests (fault injection)
    if args.executor == "ray":
        from moe_runtime.executor import cluster as cluster_mod  # imports ray: only here
        from moe_runtime.executor import ray_executor  # imports ray: only here

        runtime.cluster = cluster_mod
        tp_size = args.tensor_parallel_size
        pp_size = args.pipeline_parallel_size
        # a DP rank takes T x P rank slots (T tensor-parallel actors of each of P stages)
        slots = (
            tp_size
            * pp_size
            * max(
                8,
                max(num_ranks, args.max_data_parallel_size or 0)
                + args.warm_spare_ranks
                + args.rank_pool,
            )
        )
        runtime.owns_ray = cluster_mod.connect(num_rank_slots=slots)
        use_gpu = {"auto": None, "cpu": False, "cuda": True}[args.device]
        runtime.executor = ray_executor.RayExecutor(
            num_ranks,
            dtype=dtype,
            step_mode=args.step_mode,
            use_gpu=use_gpu,
            rank_hooks=rank_hooks,
            tp_size=tp_size,
            pp_size=pp_size,
            pp_micro_batch_tokens=args.pipeline_micro_batch_tokens,
            pp_interleave=args.pipeline_interleave is not False,  # on unless turned off
            expert_layout=expert_layout(args),
        )
    else:
        from moe_runtime.executor import local

        device = args.device
        if device == flags.DEVICE_AUTO:
            device = flags.DEVICE_CUDA if torch.cuda.is_available() else flags.DEVICE_CPU
        runtime.executor = local.LocalExecutor(
            num_ranks, device=device, dtype=dtype, rank_hooks=rank_hooks
        )
    executor = runtime.executor
    log.info(
        "serve: loading %s (%s, %s) on %d ranks (%s executor)",
        args.model,
        cfg.family,
        dtype,
        num_ranks,
        args.executor,
    )
    executor.start(args.model, placement=placement)
    if args.skip_tokenizer_init:
        tok: tokenizer_mod.Tokenizer = tokenizer_mod.NoTokenizer(
            vocab_size=cfg.vocab_size,
            bos_token_id=cfg.bos_token_id,
            eos_token_id=cfg.eos_token_id,
            stop_token_ids=cfg.all_stop_token_ids,
            reason="served with --skip-tokenizer-init",
        )
    else:
        tok = src.tokenizer()
    runtime.engine = engine = core.Engine(
        executor,
        tok,
        seam.EngineConfig(
            max_model_len=cfg.max_position_embeddings,
            max_num_seqs_per_rank=args.max_num_seqs,
            max_tokens_per_step=max(args.max_tokens_per_step, args.max_num_seqs),
            kv_budget=_kv_budget(args, cfg, dtype, num_physical).per_rank,
            kv_block_size=kv_mod.BLOCK_SIZE,
        ),
        max_queued_requests=args.max_queued_requests or None,
    )
    log.info(
        "serve: KV budget %s positions a rank at %d ranks",
        engine.scheduler.kv_tokens_per_rank,
        num_ranks,
    )
    metrics = metrics_mod.RuntimeMetrics(stats=engine.stats)
    engine.set_observer(metrics)
    max_size = args.max_data_parallel_size or max(8, num_ranks)
    runtime.elastic = elastic = elastic_service.ElasticService.attach(
        engine=engine,
        executor=executor,
        model_config=cfg,
        placement=placement,
        config=elastic_serving.ElasticConfig(
            source=args.model,
            num_redundant_experts=args.num_redundant_experts,
            slot_multiple=multiple,
            weight_source=args.weight_source,
            eplb_enabled=args.eplb,
            eplb_window_size=args.eplb_window_size,
            eplb_step_interval=args.eplb_step_interval,
            auto_recover=args.auto_recover,
            hang_timeout=args.rank_hang_timeout,
            warm_spare_ranks=args.warm_spare_ranks,
            rank_pool=args.rank_pool,
        ),
        limits=elastic_coordinator.Limits(
            min_size=args.min_data_parallel_size,
            max_size=max_size,
            num_experts=cfg.num_experts,
            num_redundant_experts=args.num_redundant_experts,
            max_experts_per_rank=args.max_experts_per_rank,
        ),
        registry=metrics.registry,
        drain_timeout=float(args.drain_timeout),
    )
    if getattr(args, "log_format", "text") == "json":
        elastic.coordinator.on_change(RESIZE_CONTEXT.on_change)
    runtime.app = server.create_app(
        engine,
        served_model_name=runtime.name,
        metrics=metrics,
        vocab_size=cfg.vocab_size,
        admin_router=elastic.router(token=tokens),
        readiness=elastic.readiness,
        chat_template=None if args.skip_tokenizer_init else src.chat_template(),
    )
    engine.start()


def serve(args: argparse.Namespace) -> int:
    """Runs the server until SIGINT/SIGTERM; returns the exit status."""
    # Until uvicorn takes over the signals, SIGTERM unwinds through the finally below.
    signal.signal(signal.SIGTERM, _raise_exit)
    started = time.monotonic()
    try:
        src = source_mod.open_source(args.model)
    except (OSError, ValueError) as exc:
        log.error("serve: cannot open model %r: %s", args.model, exc)
        return termination.failed(f"cannot open model {args.model}: {exc}")
    unsupported = _unsupported_mesh(args, src.config)
    if unsupported:
        log.error("serve: %s", unsupported)
        return termination.failed(unsupported)
    try:
        tokens = elastic_admin.token_source(
            token=args.admin_token, token_file=args.admin_token_file
        )
    except ValueError as exc:
        log.error("serve: admin token: %s", exc)
        return termination.failed(f"admin token: {exc}")

    status = 0
    runtime: Runtime | None = None  # set once built (`build` stops what it started on failure)
    building = Runtime()
    try:

        def rank_loads() -> list[dict[str, Any]]:  # asked from the loading server's thread
            executor = building.executor
            return [] if executor is None else list(executor.load_progress())

        progress = loading_server.progress_from(rank_loads, ranks_total=args.data_parallel_size)
        with loading_server.LoadingServer(progress, host=args.host, port=args.port):
            runtime = build(args, src=src, tokens=tokens, runtime=building)
        log.info(
            "serve: model '%s' ready on %d ranks in %.1f s; listening on http://%s:%d",
            runtime.name,
            args.data_parallel_size,
            time.monotonic() - started,
            args.host,
            args.port,
        )
        assert runtime.app is not None and runtime.elastic is not None
        config = uvicorn.Config(
            runtime.app,
            host=args.host,
            port=args.port,
            log_config=None,
            access_log=False,
            # a stop signal: new connections refused at once, the requests in flight get
            # this long to finish, then the rest are ended (uvicorn cancels their tasks, and
            # a cancelled request is aborted in the engine) and `runtime.close` stops the ranks
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
        _Server(config, on_exit=runtime.elastic.close).run()
    except KeyboardInterrupt:
        log.info("serve: interrupted")
    except SystemExit as exc:
        # A stop signal arrives as SystemExit (ours: 128 + signum; Ray's driver handler:
        # signum); anything else (uvicorn could not bind the port: 1) is a failure.
        stops = {None, 0, *(n for sig in (signal.SIGTERM, signal.SIGINT) for n in (sig, 128 + sig))}
        if exc.code not in stops:
            status = exc.code if isinstance(exc.code, int) else 1
        log.info("serve: exiting (%s)", exc.code)
    except Exception as exc:
        log.exception("serve: failed (model %s, %d ranks)", args.model, args.data_parallel_size)
        status = termination.failed(
            f"failed (model {args.model}, {args.data_parallel_size} ranks): "
            f"{type(exc).__name__}: {termination.first_line(exc)}"
        )
    finally:
        if runtime is not None:
            runtime.close()
    return status


class _Server(uvicorn.Server):
    """uvicorn's server, which first stops fault handling when a stop signal arrives: the
    signal reaches the whole process group, rank actors included, and their deaths are a
    shutdown, not a loss to recover from."""

    def __init__(self, config: uvicorn.Config, *, on_exit: Any) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def _shutdown(engine: core.Engine | None, executor: Any, cluster: Any, *, owns_ray: bool) -> None:
    log.info("serve: shutting down")
    if engine is not None:
        engine.stop()
    if executor is not None:
        try:
            executor.shutdown()
        except Exception:
            log.exception("serve: executor shutdown failed")
    if cluster is not None:
        cluster.disconnect()  # stops the local Ray instance when owns_ray, else just leaves
        if owns_ray:
            log.info("serve: local Ray instance stopped")
    log.info("serve: stopped")


def _default_name(model: str) -> str:
    if model.startswith("synthetic://"):
        return model[len("synthetic://") :].split("?", 1)[0]
    return model.rstrip("/").rsplit("/", 1)[-1]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    json_lines = getattr(args, "log_format", "text") == "json"
    logs.configure(args.log_level, json_lines=json_lines, context=RESIZE_CONTEXT)
    # the rank processes of a local Ray instance inherit these
    os.environ[logs.LEVEL_ENV] = args.log_level.upper()
    if json_lines:
        os.environ[logs.FORMAT_ENV] = "json"
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
