"""Admission: which waiting work becomes a running sequence, at each pass of the engine thread.

Sequences that left a rank with no room elsewhere (a shrink's migrations past the survivors'
KV budgets) go first, in order; then the request queue's head, first come, first served, while
some rank has a sequence slot and KV room for the request's prompt + max_tokens.
"""

from __future__ import annotations

from moe_runtime.engine import outputs as outputs_mod
from moe_runtime.engine import queue as queue_mod
from moe_runtime.engine import request as req
from moe_runtime.engine import scheduler as scheduler_mod
from moe_runtime.engine import text as text_mod


def admit(
    scheduler: scheduler_mod.Scheduler,
    queue: queue_mod.RequestQueue,
    outputs: outputs_mod.Outputs,
    *,
    max_model_len: int,
    tokenizer: text_mod.Decoder,
) -> bool:
    """Places the waiting sequences, then admits from the queue's head while there is room;
    True when any sequence was placed or admitted (the next step may carry more)."""
    waiting = len(scheduler.waiting)
    placed_all = scheduler.place_waiting()
    admitted = len(scheduler.waiting) < waiting
    if not placed_all:
        return admitted  # migrated sequences wait for room first, ahead of the queue
    while (handle := queue.head()) is not None:
        if scheduler.find(handle.request_id) is not None:
            queue.pop_head(admitted=False)
            outputs.finish_unstarted(
                handle, req.FinishReason.ERROR, f"duplicate request id {handle.request_id}"
            )
            continue
        if not scheduler.admit(handle, max_model_len, tokenizer):
            return admitted  # no sequence slot or KV room: it waits (first come, first served)
        queue.pop_head(admitted=True)
        admitted = True
    return admitted
