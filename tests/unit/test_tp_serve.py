"""Serving at tensor-parallel size T > 1, the pieces (docs/TENSOR-PARALLEL.md): the placement
bundles of a DP rank, the MoE reduce where only the leader runs routed experts, the leader's
view of its followers (a lost one fails the DP rank), and the start-up refusals."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from moe_runtime import cli
from moe_runtime.executor import ray_bundles
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import kv, source, tensor_parallel
from moe_runtime.rank import tensor_group, worker
from tests.support import checkpoints, hf_families, tp_ranks


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


@pytest.mark.parametrize(
    ("size", "gpu", "want"),
    [
        (1, False, [{"moe_rank": 1}]),
        (2, False, [{"moe_rank": 1}] * 2),
        (4, True, [{"moe_rank": 1, "GPU": 1}] * 4),
    ],
)
def test_a_dp_rank_takes_one_bundle_per_tp_rank(size: int, gpu: bool, want: list[Any]) -> None:
    assert ray_bundles.bundles(size, use_gpu=gpu) == want
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        ray_bundles.bundles(0, use_gpu=False)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, source.ModelSource]:
    root = tmp_path_factory.mktemp("tp_serve")
    out = {}
    for family in ("mixtral", "qwen2_moe", "deepseek_v3"):  # qwen2_moe: a gated shared expert
        model = hf_families.build(family)
        out[family] = source.open_source(str(hf_families.save(model, root / family)))
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_followers_add_zeros_to_the_moe_reduce_and_logits_equal_one_process(
    sources: dict[str, source.ModelSource], family: str
) -> None:
    """Only TP rank 0 holds experts (the followers' backend raises if called): the logits of a
    prefill and a decode step equal T = 1's, on every TP rank."""
    src = sources[family]
    prompts = [[1, 5, 9, 200, 3], [1, 7]]
    whole = decoder_logits(src, None, 0, 1, prompts)

    def rank(g: tp_ranks.ThreadGroup) -> list[torch.Tensor]:
        return decoder_logits(src, g, g.rank, 2, prompts)

    for logits in tp_ranks.run_threads(2, rank):
        for got, want in zip(logits, whole, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_in_the_mesh_layout_each_tp_rank_runs_its_rows_and_logits_equal_one_process(
    sources: dict[str, source.ModelSource], family: str
) -> None:
    """`tensor_parallel.MESH`: each TP rank sends only rows rank, rank + T, ... to its experts
    (here all of them, local) and the routed output is summed apart from the shared experts'
    partials (Qwen2-MoE's gated, DeepSeek-V3's plain): the logits of a prefill of three
    prompts (an odd row count) and a decode step equal T = 1's, on every TP rank."""
    src = sources[family]
    prompts = [[1, 5, 9, 200, 3], [1, 7], [4, 4, 8]]
    whole = decoder_logits(src, None, 0, 1, prompts)
    rows: list[list[int]] = [[], []]

    def rank(g: tp_ranks.ThreadGroup) -> list[torch.Tensor]:
        local = experts_mod.LocalExperts.from_source(src)

        def experts(layer: int, hidden: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
            rows[g.rank].append(hidden.shape[0])
            return local(layer, hidden, *rest)

        return decoder_logits(
            src, g, g.rank, 2, prompts, layout=tensor_parallel.MESH, experts=experts
        )

    for logits in tp_ranks.run_threads(2, rank):
        for got, want in zip(logits, whole, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    layers = src.config.num_moe_layers
    # the prefill's 10 rows split 5 / 5, the decode step's 3 rows 2 / 1, in every MoE layer
    assert rows == [[5] * layers + [2] * layers, [5] * layers + [1] * layers]


def decoder_logits(
    src: source.ModelSource,
    g: Any,
    rank: int,
    size: int,
    prompts: list[list[int]],
    *,
    layout: str = tensor_parallel.LEADER,
    experts: Any = None,
) -> list[torch.Tensor]:
    if g is None:
        from moe_runtime.model import decoder

        model = decoder.MoEModel.from_source(src)
    else:
        model = tp_ranks.tp_model(src, g, rank, size, layout=layout)
    if experts is None:
        experts = tp_ranks.experts_for(src, rank)
    cache = kv.KVCache(model.local_config)
    ids = [f"s{i}" for i in range(len(prompts))]
    first = model.forward(kv.ForwardBatch(ids, prompts, [0] * len(prompts)), cache, experts)
    nxt = [[int(t)] for t in first.argmax(-1)]
    second = model.forward(kv.ForwardBatch(ids, nxt, [len(p) for p in prompts]), cache, experts)
    return [first, second]


class _Followers:
    """`tensor_group.Followers` that say what the test wants."""

    def __init__(self) -> None:
        self.lost: str | None = None

    def send(self, method: str, *args: Any) -> Any:
        return method

    def wait(self, pending: Any, timeout: float | None) -> list[Any]:
        if self.lost is not None:
            raise tensor_group.FollowerLost(self.lost)
        return [None]

    def alive(self) -> str | None:
        return self.lost

    def pids(self) -> list[int]:
        return [4242]


def test_a_lost_follower_fails_its_leader() -> None:
    """A dead or hung follower makes its leader's pings raise RankFailed (the heartbeat then
    reports the DP rank lost and the recovery takes it out); the leader says its followers'
    processes."""
    followers = _Followers()
    rank = worker.RankWorker(device="cpu", tensor=followers, tensor_size=2)
    assert rank.info()["tp_pids"] == [4242] and rank.info()["tp_size"] == 2
    rank.ping()
    followers.lost = "TP follower 1 (pid 4242) died"
    with pytest.raises(worker.RankFailed, match="follower is lost: TP follower 1"):
        rank.ping()
    with pytest.raises(ValueError, match="needs the rank's followers"):
        worker.RankWorker(device="cpu", tensor_size=2)


pytestmark = pytest.mark.usefixtures("keep_sigterm")  # tests/unit/conftest.py


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--tensor-parallel-size", "3"],
            "--tensor-parallel-size 3 does not fit this model: tensor parallel size 3 must "
            "divide num_heads (num_attention_heads) (4)",
        ),
        (
            ["--tensor-parallel-size", "2", "--executor", "local"],
            "--tensor-parallel-size 2 needs the Ray executor",
        ),
        (
            # T and P together: each is checked against the model
            ["--pipeline-parallel-size", "2", "--no-eplb", "--tensor-parallel-size", "3"],
            "--tensor-parallel-size 3 does not fit this model",
        ),
        (
            ["--pipeline-parallel-size", "2", "--no-eplb", "--executor", "local"],
            "--pipeline-parallel-size 2 needs the Ray executor",
        ),
        (
            ["--pipeline-parallel-size", "4", "--no-eplb"],
            "--pipeline-parallel-size 4 does not fit this model: pipeline parallel size 4 "
            "exceeds num_layers (num_hidden_layers) 3",
        ),
        (["--expert-layout", "mesh"], "--expert-layout mesh needs --tensor-parallel-size > 1"),
    ],
    ids=[
        "tp-does-not-shard",
        "tp-local-executor",
        "pp-with-tp-that-does-not-shard",
        "pp-local-executor",
        "pp-over-layers",
        "mesh-at-tp1",
    ],
)
def test_serve_refuses_a_mesh_it_cannot_serve_at_start_up(
    tmp_path: pathlib.Path, termination_log: pathlib.Path, flags: list[str], message: str
) -> None:
    path = tmp_path / "ckpt"
    checkpoints.build(path)  # 4 heads over 2 KV heads
    argv = ["serve", "--model", str(path), "--data-parallel-size", "1", "--port", "0", *flags]
    assert cli.serve(cli.build_parser().parse_args(argv)) != 0
    assert message in termination_log.read_text()


@pytest.mark.parametrize(
    "flags",
    [
        ["--pipeline-parallel-size", "2", "--rank-pool", "1"],
        ["--pipeline-parallel-size", "2", "--tensor-parallel-size", "2", "--rank-pool", "2"],
        ["--pipeline-parallel-size", "3", "--rank-pool", "1", "--warm-spare-ranks", "1"],
    ],
    ids=["pp-rank-pool", "tp-pp-rank-pool", "pp-rank-pool-and-spares"],
)
def test_serve_accepts_the_rank_pool_at_any_mesh(tmp_path: pathlib.Path, flags: list[str]) -> None:
    """A pooled rank is a whole DP rank of T x P actors (docs/PIPELINE-PARALLEL.md): the
    pool is no reason to refuse a mesh (tests/integration/test_tp_rank_pool.py serves it)."""
    path = tmp_path / "ckpt"
    checkpoints.build(path)  # 4 heads over 2 KV heads, 3 layers
    argv = ["serve", "--model", str(path), "--data-parallel-size", "1", *flags]
    args = cli.build_parser().parse_args(argv)
    assert cli._unsupported_mesh(args, source.open_source(str(path)).config) is None
