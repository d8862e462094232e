"""Tokenizers: a `tokenizer.json` through the `tokenizers` library, a byte-level fallback, or
none at all (token ids only).

The byte-level tokenizer maps ids 0..255 to bytes and adds two special ids, BOS (256) and EOS
(257); it serves synthetic models and checkpoints that ship no `tokenizer.json`. A checkpoint
without `tokenizer.json` whose vocabulary is smaller than those 258 ids (or any model served
with `--skip-tokenizer-init`) gets `NoTokenizer`: prompts must be token ids, and outputs carry
token ids and no text (vLLM's `--skip-tokenizer-init`).
"""

from __future__ import annotations

import os
from typing import Protocol

import tokenizers

from moe_runtime.model import errors

BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_VOCAB_SIZE = 258


class Tokenizer(Protocol):
    """Text <-> token ids. `decode` drops special tokens."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence (the model's eos ids; eos_token_id among them)."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def _stops(eos: int | None, stops: tuple[int, ...]) -> tuple[int, ...]:
    """The stop ids, eos first when it is not among them."""
    out = tuple(stops)
    if eos is not None and eos not in out:
        out = (eos, *out)
    return out


class TokenizerUnavailable(ValueError):
    """Text was given to a model served without a tokenizer."""


class NoTokenizer:
    """Token ids only: `encode` raises TokenizerUnavailable, `decode` gives no text.

    reason: why there is no tokenizer (said in the error a text prompt gets).
    """

    has_text = False

    def __init__(
        self,
        *,
        vocab_size: int,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        stop_token_ids: tuple[int, ...] = (),
        reason: str = "the model is served without a tokenizer",
    ) -> None:
        self._vocab_size = vocab_size
        self._bos = bos_token_id
        self._eos = eos_token_id
        self._stops = _stops(eos_token_id, stop_token_ids)
        self.reason = reason

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stops

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise TokenizerUnavailable(
            f"this model has no tokenizer ({self.reason}): send the prompt as a list of token "
            f"ids in [0, {self._vocab_size})"
        )

    def decode(self, ids: list[int]) -> str:
        return ""


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, BOS = 256, EOS = 257; encode prepends BOS.

    stop_token_ids: what ends a sequence (a checkpoint's own eos ids when it falls back to
    bytes for want of a tokenizer.json); EOS by default.
    """

    def __init__(self, *, stop_token_ids: tuple[int, ...] = (BYTE_EOS_ID,)) -> None:
        self._stops = tuple(stop_token_ids) or (BYTE_EOS_ID,)

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def bos_token_id(self) -> int | None:
        return BYTE_BOS_ID

    @property
    def eos_token_id(self) -> int | None:
        return self._stops[0]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stops

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BYTE_BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; special and out-of-range ids are dropped, bad UTF-8 replaced."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`; eos/bos ids come from the model config when it has them."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        stop_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.path = os.fspath(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(self.path)
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exception
            raise errors.CheckpointError(self.path, f"cannot load tokenizer: {exc}") from exc
        self._bos = bos_token_id if bos_token_id is not None else self._tok.token_to_id("<s>")
        self._eos = eos_token_id if eos_token_id is not None else self._tok.token_to_id("</s>")
        self._stops = _stops(self._eos, stop_token_ids)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stops

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))
