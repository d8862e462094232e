"""What a rank has read of the weights it loads (`LoadCounter`): the counts `GET /ready`
reports while the model loads (`moe_contract.loading.RankLoad`, one per rank).

The totals are known before the first read (the shapes come from the model's config and the
dtype the rank serves in), so a counter says "12.4 of 60.1 MB" from the start. Counts are in
the served dtype: what the rank will hold, not what the files store. Thread-safe: the load
runs on one thread and the executor asks for a snapshot from another.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from moe_contract import loading


def nbytes(shapes: Iterable[Sequence[int]], element_size: int) -> int:
    """Bytes of tensors of these shapes, `element_size` bytes an element."""
    return sum(math.prod(shape) for shape in shapes) * element_size


class LoadCounter:
    """Tensors and bytes read of a load's totals (`begin`, `add`, `finish`, `snapshot`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._load = loading.RankLoad(rank=-1)

    def begin(self, *, rank: int, tensors_total: int, bytes_total: int) -> None:
        """A new load: nothing read yet of these totals."""
        with self._lock:
            self._load = loading.RankLoad(
                rank=rank, tensors_total=tensors_total, bytes_total=bytes_total
            )

    def add(self, *, tensors: int, nbytes: int) -> None:
        """`tensors` more tensors of `nbytes` bytes are in."""
        with self._lock:
            self._load = self._load.model_copy(
                update={
                    "tensors_loaded": self._load.tensors_loaded + tensors,
                    "bytes_loaded": self._load.bytes_loaded + nbytes,
                }
            )

    def finish(self) -> None:
        """Every tensor is in."""
        with self._lock:
            self._load = self._load.model_copy(update={"done": True})

    def snapshot(self) -> dict[str, Any]:
        """`moe_contract.loading.RankLoad` as JSON (built strictly)."""
        with self._lock:
            load = self._load
        return loading.RankLoad.exact(load.model_dump()).to_json()
