"""What a checkpoint reader reads: `ReadCounter` wraps `safetensors.safe_open` and records
every tensor read (whole, or a slice of rows of a fused expert tensor) with its bytes.

Install it with `monkeypatch.setattr(safetensors, "safe_open", counter.safe_open)` (the
runtime's checkpoint reader looks the function up on the module at each read).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import safetensors

_REAL_SAFE_OPEN = safetensors.safe_open
#: A per-expert stored name: `...experts.7.w1.weight` / `...experts.7.gate_proj.weight`.
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Read:
    """One read: the stored tensor, the rows asked (`None`: all of it), the bytes read."""

    stored: str
    rows: tuple[int, int] | None
    nbytes: int

    @property
    def expert(self) -> int | None:
        """The expert this read belongs to (a per-expert name, or one row of a fused routed
        expert tensor); `None` for a non-expert tensor."""
        found = _PER_EXPERT.search(self.stored)
        if found is not None:
            return int(found.group(1))
        if self.rows is not None and self.rows[1] - self.rows[0] == 1:
            return self.rows[0]
        return None

    @property
    def whole_fused_experts(self) -> bool:
        """A fused expert tensor (every expert of a layer) read whole: never allowed."""
        return self.rows is None and ".experts." in self.stored and self.expert is None


class ReadCounter:
    """Records every tensor read through `safe_open` (see the module docstring)."""

    def __init__(self) -> None:
        self.reads: list[Read] = []

    def safe_open(self, filename: str, framework: str, **kw: Any) -> _Handle:
        return _Handle(_REAL_SAFE_OPEN(filename, framework=framework, **kw), self)

    def clear(self) -> None:
        self.reads.clear()

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)


class _Handle:
    def __init__(self, handle: Any, counter: ReadCounter) -> None:
        self._handle = handle
        self._counter = counter

    def __enter__(self) -> _Handle:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def metadata(self) -> Any:
        return self._handle.metadata()

    def get_tensor(self, name: str) -> Any:
        value = self._handle.get_tensor(name)
        self._counter.reads.append(Read(name, None, value.numel() * value.element_size()))
        return value

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self._handle.get_slice(name), name, self._counter)


class _Slice:
    def __init__(self, view: Any, name: str, counter: ReadCounter) -> None:
        self._view = view
        self._name = name
        self._counter = counter

    def get_shape(self) -> list[int]:
        return list(self._view.get_shape())

    def get_dtype(self) -> str:
        return str(self._view.get_dtype())

    def __getitem__(self, index: Any) -> Any:
        value = self._view[index]
        rows = (index.start, index.stop) if isinstance(index, slice) else None
        self._counter.reads.append(Read(self._name, rows, value.numel() * value.element_size()))
        return value
