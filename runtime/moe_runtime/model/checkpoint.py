"""A local Hugging Face checkpoint as shipped, read one tensor at a time (`CheckpointSource`).

What is read: `config.json` (any supported family; `families`), `generation_config.json`
(its stop ids), one `*.safetensors` file or several with `model.safetensors.index.json`,
`tokenizer.json`, the chat template (`chat_template.jinja` or `tokenizer_config.json`).
Routed experts are exposed per expert under the family's names (`names`) whether the
checkpoint stores them so or fused (transformers 5: `mlp.experts.gate_up_proj` and
`down_proj` for every expert of a layer; gpt-oss always); quantised weights are dequantised
(`quant`). Every stored tensor must be used: one that is not is an error naming it, unless
the family skips it on purpose (DeepSeek-V3's multi-token-prediction layers: one log line).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from typing import Any

import safetensors
import torch

from moe_runtime.model import chat_template as chat_mod
from moe_runtime.model import config as config_mod
from moe_runtime.model import errors, families, layout, names, quant, tokenizer

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
#: A buffer older transformers saved with the weights; every family recomputes it.
ROTARY_BUFFER = "rotary_emb.inv_freq"

_SafetensorsErrors = (safetensors.SafetensorError, OSError)
#: Stored dtypes that are never weights to cast: they need a dequantisation we know.
_QUANTISED_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8}


@dataclasses.dataclass(frozen=True)
class _Location:
    """Where one of our tensors lives: the stored name and how to get ours from it.

    expert / part: a slice of a fused tensor [E, ...] (`part` says which rows);
    scale: the FP8 `weight_scale_inv` beside it; mxfp4: stored as `_blocks` + `_scales`.
    """

    stored: str
    expert: int | None = None
    part: layout.FusedPart | None = None
    scale: str | None = None
    mxfp4: bool = False

    def stored_names(self) -> list[str]:
        if self.mxfp4:
            return [self.stored + quant.BLOCKS_SUFFIX, self.stored + quant.SCALES_SUFFIX]
        return [self.stored] + ([self.scale] if self.scale else [])


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise errors.CheckpointError(path, f"unreadable JSON: {exc}") from exc


class CheckpointSource:
    """A local Hugging Face checkpoint, read lazily with `safetensors.safe_open`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        if not self.path.is_dir():
            raise errors.CheckpointError(
                self.path, "no such checkpoint directory (or use synthetic://NAME)"
            )
        config_path = self.path / CONFIG_FILE
        if not config_path.is_file():
            raise errors.CheckpointError(
                config_path, "missing: a Hugging Face checkpoint needs config.json"
            )
        hf = _read_json(config_path)
        if not isinstance(hf, dict):
            raise errors.CheckpointError(config_path, "must hold a JSON object")
        gen_path = self.path / GENERATION_FILE
        generation = _read_json(gen_path) if gen_path.is_file() else None
        if generation is not None and not isinstance(generation, dict):
            raise errors.CheckpointError(gen_path, "must hold a JSON object")
        self._config = families.from_hf_config(
            hf, config_path, generation=generation, generation_path=gen_path
        )
        self._quant = quant.Quantization.read(hf, config_path)
        self._naming = families.by_name(self._config.family).naming
        self._where = self._read_weight_map()
        self._weights_desc = (
            str(self.path / INDEX_FILE)
            if (self.path / INDEX_FILE).exists()
            else ", ".join(sorted({str(p) for p in self._where.values()}))
        )
        self._locations = {
            name: self._locate(name) for name in names.all_tensor_names(self._config)
        }
        self._check_all_used()
        #: The last fused expert row read ((stored name, expert), tensor): `_read_stored`.
        self._last_row: tuple[tuple[str, int | None], torch.Tensor] | None = None

    # -- the files ---------------------------------------------------------------------------
    def _read_weight_map(self) -> dict[str, pathlib.Path]:
        """Stored tensor name -> the shard file holding it."""
        index_path = self.path / INDEX_FILE
        if index_path.exists():
            index = _read_json(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise errors.CheckpointError(
                    index_path, "no 'weight_map' object of tensor name -> shard file"
                )
            for shard in sorted(set(weight_map.values())):
                if pathlib.PurePath(shard).is_absolute() or ".." in pathlib.PurePath(shard).parts:
                    raise errors.CheckpointError(
                        index_path, f"shard {shard!r} is not a file name inside the checkpoint"
                    )
                if not (self.path / shard).is_file():
                    raise errors.CheckpointError(
                        index_path, f"points to shard {shard!r}, which does not exist"
                    )
            return {key: self.path / shard for key, shard in weight_map.items()}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise errors.CheckpointError(self.path, "no *.safetensors weights file")
        where: dict[str, pathlib.Path] = {}
        for file in files:
            try:
                with safetensors.safe_open(str(file), framework="pt") as handle:
                    keys = list(handle.keys())
            except _SafetensorsErrors as exc:
                raise errors.CheckpointError(
                    file, f"not a readable safetensors file: {exc}"
                ) from exc
            for key in keys:
                if key in where:
                    raise errors.CheckpointError(
                        file, f"tensor {key!r} is also in {where[key]}; add {INDEX_FILE}"
                    )
                where[key] = file
        return where

    # -- where each tensor is ----------------------------------------------------------------
    def _direct(self, stored: str) -> _Location | None:
        if stored in self._where:
            scale = stored + quant.SCALE_SUFFIX if stored.endswith(".weight") else None
            has_scale = scale is not None and scale in self._where
            if has_scale and self._quant.method != "fp8":
                raise errors.CheckpointError(
                    self._weights_desc,
                    f"{scale!r} is a block-FP8 scale but config.json has no fp8 "
                    f"quantization_config: refusing to guess the quantisation",
                )
            return _Location(stored=stored, scale=scale if has_scale else None)
        return None

    def _locate(self, name: str) -> _Location:
        """Where one of our tensors is stored; CheckpointError when absent."""
        found = self._direct(name)
        if found is not None:
            return found
        cfg = self._config
        entry = names.entry(cfg, name)
        prefix = names.layer_prefix(entry.layer)
        if entry.is_expert:
            fused = self._naming.fused.get(entry.role)
            if fused is not None:
                stored = prefix + fused.stored
                if stored in self._where:
                    return _Location(stored=stored, expert=entry.expert, part=fused)
                blocks = stored + quant.BLOCKS_SUFFIX
                if self._quant.method == "mxfp4" and blocks in self._where:
                    return _Location(stored=stored, expert=entry.expert, part=fused, mxfp4=True)
        elif entry.layer >= 0:
            suffix = name[len(prefix) :]
            for stored_suffix, ours in self._naming.aliases.items():
                if ours == suffix:
                    found = self._direct(prefix + stored_suffix)
                    if found is not None:
                        return found
        if name == names.LM_HEAD and cfg.tie_word_embeddings:
            return self._locate(names.EMBED)
        raise errors.CheckpointError(self._weights_desc, f"missing tensor {name!r}")

    def _check_all_used(self) -> None:
        used = {s for loc in self._locations.values() for s in loc.stored_names()}
        if self._config.tie_word_embeddings:
            used.add(names.LM_HEAD)  # some tied checkpoints store it anyway
        unused = sorted(set(self._where) - used)
        skipped: dict[str, list[str]] = {}
        refused: list[str] = []
        skip = families.by_name(self._config.family).skip
        for stored in unused:
            reason = skip(self._config, stored)
            if reason is None and stored.endswith(ROTARY_BUFFER):
                reason = "rotary frequencies (computed from config.json)"
            if reason is None:
                refused.append(stored)
            else:
                skipped.setdefault(reason, []).append(stored)
        if refused:
            raise errors.CheckpointError(
                self._weights_desc,
                f"{len(refused)} stored tensors are not used by the {self._config.family} "
                f"model (a layout or variant this runtime does not read): {refused[:8]}",
            )
        for reason, skipped_names in skipped.items():
            log.info("%s: skipping %d tensors of %s", self.path, len(skipped_names), reason)

    # -- the ModelSource interface -----------------------------------------------------------
    @property
    def config(self) -> config_mod.ModelConfig:
        return self._config

    @property
    def description(self) -> str:
        return str(self.path)

    def tensor(self, name: str) -> torch.Tensor:
        expected = names.tensor_shape(self._config, name)
        loc = self._locations.get(name)
        if loc is None:
            raise KeyError(f"{name!r} is not a tensor of this model")
        value = self._read(loc)
        if tuple(value.shape) != expected:
            stored = "" if loc.stored == name else f" (stored in {loc.stored!r})"
            raise errors.CheckpointError(
                self._where[loc.stored_names()[0]],
                f"tensor {name!r}{stored} has shape {list(value.shape)}, but config.json "
                f"implies {list(expected)}",
            )
        return value

    def tensor_slice(self, name: str, *, dim: int, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of dimension `dim` of tensor `name`: only those bytes are
        read where the tensor is stored whole (not fused); a block-FP8 weight reads the
        blocks the slice touches and their scales (`_fp8_slice`); a fused or MXFP4 tensor is
        read whole and cut."""
        expected = names.tensor_shape(self._config, name)
        if not 0 <= dim < len(expected) or not 0 <= start <= stop <= expected[dim]:
            raise ValueError(
                f"{name!r} {list(expected)}: no slice [{start}, {stop}) of dimension {dim}"
            )
        loc = self._locations[name]
        fused = loc.part is not None or loc.mxfp4 or loc.expert is not None
        if fused or (loc.scale is not None and len(expected) != 2):
            return self.tensor(name).narrow(dim, start, stop - start).clone()
        if loc.scale is not None:
            return self._fp8_slice(loc, expected, dim, start, stop)
        return self._unscaled(
            loc.stored, self._slice_stored(loc.stored, expected, dim, start, stop)
        )

    def _unscaled(self, stored: str, value: torch.Tensor) -> torch.Tensor:
        """`value` of stored tensor `stored`, which has no scale: refused when quantised."""
        if value.dtype in _QUANTISED_DTYPES:
            raise errors.CheckpointError(
                self._where[stored],
                f"tensor {stored!r} is stored as {value.dtype} with no scale to dequantise it by",
            )
        return value

    def _fp8_slice(
        self, loc: _Location, expected: tuple[int, ...], dim: int, start: int, stop: int
    ) -> torch.Tensor:
        """Elements [start, stop) of dimension `dim` of a block-FP8 weight: the whole blocks
        the slice touches are read with their rows (or columns) of scales, dequantised, and
        cut, so the values are those of the whole tensor dequantised (same products)."""
        assert loc.scale is not None
        scale = self._get(loc.scale)
        if scale.dim() < 2:  # one scale for the whole tensor
            value = self._slice_stored(loc.stored, expected, dim, start, stop)
            return quant.dequantize_fp8(value, scale, self._quant.block_size)
        block = quant.block_of(expected, tuple(scale.shape), self._quant.block_size)
        size = block[dim]
        first, last = start // size, -(-stop // size)
        lo, hi = first * size, min(last * size, expected[dim])
        value = self._slice_stored(loc.stored, expected, dim, lo, hi)
        part = quant.dequantize_fp8(value, scale.narrow(dim, first, last - first), block)
        return part.narrow(dim, start - lo, stop - start).clone()

    def _slice_stored(
        self, stored: str, expected: tuple[int, ...], dim: int, start: int, stop: int
    ) -> torch.Tensor:
        """Elements [start, stop) of dimension `dim` of stored tensor `stored` (only those
        bytes read), checked to be stored with the `expected` shape."""
        file = self._where[stored]
        index = (slice(None),) * dim + (slice(start, stop),)
        try:
            with safetensors.safe_open(str(file), framework="pt") as handle:
                view = handle.get_slice(stored)
                shape = tuple(view.get_shape())
                if shape != expected:
                    raise errors.CheckpointError(
                        file,
                        f"tensor {stored!r} has shape {list(shape)}, but config.json "
                        f"implies {list(expected)}",
                    )
                value: torch.Tensor = view[index]
        except _SafetensorsErrors as exc:
            raise errors.CheckpointError(file, f"cannot read tensor {stored!r}: {exc}") from exc
        return value

    def _get(self, stored: str, index: int | None = None) -> torch.Tensor:
        file = self._where[stored]
        try:
            with safetensors.safe_open(str(file), framework="pt") as handle:
                if stored not in handle.keys():
                    raise errors.CheckpointError(
                        file, f"tensor {stored!r} (listed in {INDEX_FILE}) is not in it"
                    )
                if index is None:
                    value: torch.Tensor = handle.get_tensor(stored)
                else:
                    view = handle.get_slice(stored)
                    if index >= view.get_shape()[0]:
                        raise errors.CheckpointError(
                            file,
                            f"tensor {stored!r} holds {view.get_shape()[0]} experts; "
                            f"config.json has {self._config.num_experts}",
                        )
                    value = view[index : index + 1]
        except _SafetensorsErrors as exc:
            raise errors.CheckpointError(file, f"cannot read tensor {stored!r}: {exc}") from exc
        return value

    def _read(self, loc: _Location) -> torch.Tensor:
        value = self._read_stored(loc)
        if loc.part is None:
            return value
        value = value[0]
        if loc.part.transpose:
            value = value.transpose(0, 1) if value.dim() == 2 else value
        select = loc.part.select
        if select == "first_half":
            value = value[: value.shape[0] // 2]
        elif select == "second_half":
            value = value[value.shape[0] // 2 :]
        elif select == "even":
            value = value[0::2]
        elif select == "odd":
            value = value[1::2]
        value = value.contiguous()
        if value.untyped_storage().nbytes() > value.numel() * value.element_size():
            # a part of the expert's fused row (gate of gate_up): its own storage, so the
            # rank holds the part's bytes, not the whole row's, for as long as it serves
            value = value.clone()
        return value

    def _read_stored(self, loc: _Location) -> torch.Tensor:
        """The stored tensor of ``loc`` (dequantised): one expert's row of a fused tensor is
        read once for its parts (gate and up of ``gate_up_proj``: kept until another is read)."""
        key = (loc.stored, loc.expert)
        if loc.part is not None and self._last_row is not None and self._last_row[0] == key:
            return self._last_row[1]
        value = self._read_raw(loc)
        self._last_row = (key, value) if loc.part is not None else None
        return value

    def _read_raw(self, loc: _Location) -> torch.Tensor:
        if loc.mxfp4:
            blocks = self._get(loc.stored + quant.BLOCKS_SUFFIX, loc.expert)
            scales = self._get(loc.stored + quant.SCALES_SUFFIX, loc.expert)
            value = quant.dequantize_mxfp4(blocks, scales)
        else:
            value = self._get(loc.stored, loc.expert)
            if loc.scale is None:
                return self._unscaled(loc.stored, value)
            scale = self._get(loc.scale, loc.expert)
            value = quant.dequantize_fp8(value, scale, self._quant.block_size)
        return value

    def tensor_names(self) -> list[str]:
        return names.all_tensor_names(self._config)

    def tokenizer(self) -> tokenizer.Tokenizer:
        cfg = self._config
        path = self.path / TOKENIZER_FILE
        if path.is_file():
            return tokenizer.HFTokenizer(
                path,
                bos_token_id=cfg.bos_token_id,
                eos_token_id=cfg.eos_token_id,
                stop_token_ids=cfg.all_stop_token_ids,
            )
        if cfg.vocab_size < tokenizer.BYTE_VOCAB_SIZE:
            # Too small for the byte-level fallback: serve token ids only (vLLM's
            # --skip-tokenizer-init), rather than refuse to start.
            return tokenizer.NoTokenizer(
                vocab_size=cfg.vocab_size,
                bos_token_id=cfg.bos_token_id,
                eos_token_id=cfg.eos_token_id,
                stop_token_ids=cfg.all_stop_token_ids,
                reason=f"{path} is missing and vocab_size {cfg.vocab_size} is below "
                f"the {tokenizer.BYTE_VOCAB_SIZE} ids of the byte-level fallback",
            )
        return tokenizer.ByteTokenizer(stop_token_ids=cfg.all_stop_token_ids)

    def chat_template(self) -> chat_mod.ChatTemplate | None:
        """The checkpoint's chat template (None when it ships none)."""
        return chat_mod.ChatTemplate.from_checkpoint(self.path)
