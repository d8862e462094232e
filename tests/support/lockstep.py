"""A minimal engine for executor tests (`Lockstep`): every step runs each unfinished
sequence's new tokens on its rank, with the model and placements those tests use."""

from __future__ import annotations

import dataclasses

from moe_runtime import step as step_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import base
from moe_runtime.model import config as config_mod
from moe_runtime.model import source as source_mod

SOURCE = "synthetic://tiny?seed=0"
PROMPTS = [[1, 5, 9, 23, 44], [1, 7, 7, 7], [1, 100, 200, 300, 400, 12], [1, 3]]
GREEDY = step_mod.SamplingParams()


@dataclasses.dataclass
class Seq:
    prompt: list[int]
    rank: int
    sampling: step_mod.SamplingParams
    max_tokens: int
    generated: list[int] = dataclasses.field(default_factory=list)
    in_kv: int = 0

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_tokens


class Lockstep:
    """A minimal engine: every step runs each unfinished sequence's new tokens on its rank."""

    def __init__(self, executor: base.Executor) -> None:
        self.executor = executor
        self.seqs: dict[str, Seq] = {}
        self.step_id = 0
        self.to_free: dict[int, list[str]] = {}

    def add(
        self,
        seq_id: str,
        prompt: list[int],
        *,
        rank: int,
        max_tokens: int,
        sampling: step_mod.SamplingParams = GREEDY,
    ) -> None:
        self.seqs[seq_id] = Seq(list(prompt), rank, sampling, max_tokens)

    def migrate(self, seq_id: str, rank: int) -> None:
        """Move a sequence to another rank: free it there, re-prefill prompt + generated."""
        seq = self.seqs[seq_id]
        self.to_free.setdefault(seq.rank, []).append(seq_id)
        seq.rank, seq.in_kv = rank, 0

    def step(self, control: dict[str, int] | None = None) -> list[step_mod.StepOutput]:
        step = self.next_step(self.step_id, control)
        self.step_id += 1
        outs = self.executor.execute_step(step)
        self.apply(outs)
        return outs

    def next_step(self, step_id: int, control: dict[str, int] | None = None) -> step_mod.StepInput:
        """The step that runs each unfinished sequence's new tokens (KV frees owed taken)."""
        batches: dict[int, step_mod.RankBatch] = {}
        for rank, ids in self.to_free.items():
            batches.setdefault(rank, step_mod.RankBatch()).free.extend(ids)
        self.to_free = {}
        for seq_id, seq in self.seqs.items():
            if seq.done:
                continue
            tokens = (seq.prompt + seq.generated)[seq.in_kv :]
            work = step_mod.SeqWork(seq_id, tokens, seq.in_kv, seq.sampling, len(seq.generated))
            batches.setdefault(seq.rank, step_mod.RankBatch()).seqs.append(work)
        return step_mod.StepInput(step_id, batches, dict(control or {}))

    def apply(self, outs: list[step_mod.StepOutput]) -> None:
        """A step's outputs: each sequence's sampled token taken (none may fail)."""
        for out in outs:
            assert out.error is None, f"rank {out.rank}: {out.error}"
            for seq_id, token in out.tokens.items():
                seq = self.seqs[seq_id]
                seq.in_kv = len(seq.prompt) + len(seq.generated)
                seq.generated.append(token)
                if seq.done:
                    self.to_free.setdefault(seq.rank, []).append(seq_id)

    def run(self) -> dict[str, list[int]]:
        while not all(s.done for s in self.seqs.values()):
            self.step()
        return {k: s.generated for k, s in self.seqs.items()}


def config() -> config_mod.ModelConfig:
    return source_mod.open_source(SOURCE).config


def identity(num_ranks: int, num_physical: int | None = None) -> policy.Placement:
    cfg = config()
    phys = num_physical or cfg.num_experts
    return policy.identity(cfg.num_moe_layers, cfg.num_experts, phys, num_ranks)
