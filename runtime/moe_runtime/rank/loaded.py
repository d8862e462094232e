"""What a rank loaded (`RankWorker.load_weights`): the model source, the non-expert weights,
its KV cache and the expert load it has counted. One object, shared by the parts that read it
(groups: the non-expert transfer; slots: expert shapes and source reads; step: the forward)."""

from __future__ import annotations

import dataclasses

import torch

from moe_runtime.model import config as config_mod
from moe_runtime.model import decoder
from moe_runtime.model import kv as kv_mod


@dataclasses.dataclass
class LoadedModel:
    """None everywhere until `load_weights`; replaced whole by it (`load`)."""

    source_name: str | None = None
    config: config_mod.ModelConfig | None = None
    model: decoder.MoEModel | None = None
    kv: kv_mod.KVCache | None = None
    #: Tokens routed per logical expert [L, E] by this rank since its weights loaded.
    total_load: torch.Tensor | None = None

    def load(
        self,
        source_name: str,
        config: config_mod.ModelConfig,
        model: decoder.MoEModel,
        kv: kv_mod.KVCache,
    ) -> None:
        """The weights of `source_name`, an empty KV cache and no load counted yet."""
        self.source_name, self.config, self.model, self.kv = source_name, config, model, kv
        self.total_load = torch.zeros(config.num_moe_layers, config.num_experts, dtype=torch.int64)

    def require(self, where: str) -> tuple[config_mod.ModelConfig, decoder.MoEModel]:
        """(config, model), or RuntimeError when nothing is loaded (`where`: the rank's log
        context)."""
        if self.config is None or self.model is None:
            raise RuntimeError(f"no weights loaded yet ({where})")
        return self.config, self.model
