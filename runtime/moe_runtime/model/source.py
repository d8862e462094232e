"""Where weights come from: `open_source(str) -> ModelSource`.

Two kinds of source, both loading one tensor at a time so a rank reads only what it holds:

- `synthetic://NAME?seed=S[&FIELD=VALUE...]` (`synthetic`): a seeded random model;
- a local directory holding a Hugging Face checkpoint of a supported family as
  `save_pretrained` writes it (`checkpoint`).
"""

from __future__ import annotations

import re
from typing import Protocol

import torch

from moe_runtime.model import chat_template as chat_mod
from moe_runtime.model import checkpoint, errors, synthetic, tokenizer
from moe_runtime.model import config as config_mod


class ModelSource(Protocol):
    """A model's configuration, tensors (by `names`), tokenizer and chat template."""

    @property
    def config(self) -> config_mod.ModelConfig: ...

    @property
    def description(self) -> str: ...

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, loaded now; KeyError for a name the model does not have."""
        ...

    def tensor_slice(self, name: str, *, dim: int, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of dimension `dim` of one tensor (a tensor-parallel shard:
        `tp_shard`), reading no more of it than the source must."""
        ...

    def tensor_names(self) -> list[str]: ...

    def tokenizer(self) -> tokenizer.Tokenizer: ...

    def chat_template(self) -> chat_mod.ChatTemplate | None:
        """The chat template (None: the model has none; the chat route answers 400)."""
        ...


def open_source(source: str) -> ModelSource:
    """Open `synthetic://NAME?seed=S` or a local Hugging Face checkpoint directory."""
    if source.startswith(synthetic.SCHEME):
        return synthetic.SyntheticSource.parse(source)
    if source.startswith("file://"):
        source = source[len("file://") :]
    elif re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", source):
        raise errors.SourceError(
            f"{source}: unsupported scheme; use synthetic://NAME?seed=S or a local directory"
        )
    return checkpoint.CheckpointSource(source)
