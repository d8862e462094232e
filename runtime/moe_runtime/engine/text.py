"""Incremental detokenisation with stop strings: turns generated token ids into text deltas.

A delta never contains text that could still turn out to be the start of a stop string, nor a
trailing U+FFFD (an incomplete multi-byte character that the next token may complete), so a
streamed answer is exactly the final answer cut into pieces.

Each token costs a decode of a few tokens, not of the whole output (vLLM's and Hugging Face's
"prefix offset / read offset" scheme): the text of ``ids[:read]`` is kept, and a new token's
text is what ``decode(ids[prefix:])`` adds to ``decode(ids[prefix:read])``, where ``prefix`` is
an earlier read offset at least ``_CONTEXT`` tokens back, so the window holds the context
that decoders look at (the leading space SentencePiece strips from a first token, "##" word
pieces, byte-fallback runs). The offsets move on only when the window's text grew and does not
end in U+FFFD: then ``read`` is a character boundary.

The text is ``decode(ids)`` at every token for the byte tokenizer (UTF-8 decoding restarts
cleanly after a complete character, so a window starting there decodes to the same suffix) and
for decoders whose output depends on a bounded context of earlier tokens (Hugging Face
ByteLevel, Metaspace, ByteFallback + Fuse, WordPiece). When the window's text does not start
with the text it had before (a decoder that rewrote earlier characters, e.g. byte-fallback
bytes that became invalid UTF-8 together), that token falls back to one full decode, and the
offsets move on from there as usual.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Fewest tokens the window keeps before the read offset. One is not enough: byte-fallback
# decoders decode a run of <0xNN> tokens as one group, so a byte that makes the run invalid
# UTF-8 turns the characters before it into U+FFFD, and a one-token window whose text is empty
# (a space stripped as the first token's) cannot see that its earlier text changed.
_CONTEXT = 4


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
        self._text = ""  # decode(self._ids), see the module docstring
        self._emitted = 0
        self._searched = 0
        self.stopped = False
        # decode(ids[:read]) for read = the last of _reads (past read offsets, all character
        # boundaries); the window ids[prefix:] and decode(ids[prefix:read])
        self._committed = ""
        self._reads: collections.deque[int] = collections.deque([0])
        self._prefix = 0
        self._prefix_text = ""

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
            self._text = self._decode_next()
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

    def _decode_next(self) -> str:
        """decode(self._ids) after one more id, from the window ids[prefix:]."""
        window = self._decoder.decode(self._ids[self._prefix :])
        if window.startswith(self._prefix_text):
            text = self._committed + window[len(self._prefix_text) :]
        else:
            text = self._decoder.decode(self._ids)  # the decoder rewrote earlier text
        if len(window) > len(self._prefix_text) and not window.endswith(_REPLACEMENT):
            self._committed = text
            self._reads.append(len(self._ids))
            # The window starts at the last read offset at least _CONTEXT tokens back.
            while len(self._reads) > 2 and self._reads[1] <= len(self._ids) - _CONTEXT:
                self._reads.popleft()
            if self._reads[0] == self._prefix:
                self._prefix_text = window
            else:
                self._prefix = self._reads[0]
                self._prefix_text = self._decoder.decode(self._ids[self._prefix :])
        return text

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
