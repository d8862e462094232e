"""The detokeniser as it was before it became incremental (`FullDecodeText`): the oracle that
`engine.text.IncrementalText` must match delta for delta (tests/unit/test_engine_text.py,
bench/engine.py)."""

from __future__ import annotations

from collections.abc import Sequence

from moe_runtime.engine import text


class FullDecodeText:
    """The detokeniser as it was before it became incremental: a full decode on every token.
    The oracle that ``text.IncrementalText`` must match delta for delta."""

    def __init__(self, decoder: text.Decoder, *, stop: Sequence[str] = ()) -> None:
        self._decoder = decoder
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self._text = ""
        self._emitted = 0
        self._searched = 0
        self.stopped = False

    def append(self, token_id: int) -> str:
        if self.stopped:
            return ""
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
        return self._release(len(self._text))

    def _safe_end(self) -> int:
        end = len(self._text)
        while end > self._emitted and self._text[end - 1] == "\ufffd":
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
