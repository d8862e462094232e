"""Incremental detokenisation with stop strings: turns generated token ids into text deltas.

A delta never contains text that could still turn out to be the start of a stop string, nor a
trailing U+FFFD (an incomplete multi-byte character that the next token may complete), so a
streamed answer is exactly the final answer cut into pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """The part of a tokenizer this module needs."""

    def decode(self, token_ids: list[int]) -> str: ...


class IncrementalText:
    """The text of one sequence's generated tokens, released in deltas.

    `stop`: strings that end the generation; the returned text excludes the stop string and
    everything after it (OpenAI semantics). `skip_token_id` (EOS) is left out of the text.
    """

    def __init__(
        self, decoder: Decoder, *, stop: Sequence[str] = (), skip_token_id: int | None = None
    ) -> None:
        self._decoder = decoder
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._skip = skip_token_id
        self._ids: list[int] = []
        self._text = ""
        self._emitted = 0
        self._searched = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """The text released so far."""
        return self._text[: self._emitted]

    def append(self, token_id: int) -> str:
        """Adds one generated token; returns the text that can be released now (maybe "")."""
        if self.stopped:
            return ""
        if token_id != self._skip:
            self._ids.append(token_id)
        self._text = self._decoder.decode(self._ids)
        if self._stop:
            start = max(0, self._searched - self._max_stop + 1)
            hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self._text = self._text[: min(hits)]
                self.stopped = True
                return self._release(len(self._text))
            self._searched = len(self._text)
        return self._release(self._safe_end())

    def flush(self) -> str:
        """Releases everything held back (the sequence finished for another reason)."""
        return self._release(len(self._text))

    def _safe_end(self) -> int:
        end = len(self._text)
        while end > self._emitted and self._text[end - 1] == _REPLACEMENT:
            end -= 1
        if self._stop:
            tail = self._text[max(self._emitted, end - self._max_stop + 1) : end]
            for k in range(len(tail), 0, -1):
                if any(s.startswith(tail[-k:]) for s in self._stop):
                    end -= k
                    break
        return max(end, self._emitted)

    def _release(self, end: int) -> str:
        delta = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta
