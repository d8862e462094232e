"""Live settings of a serving process: what `GET/PATCH /elastic_ep/config` reads and changes.

Every field is applied without a restart; none needs a step boundary:

| field | applied |
|---|---|
| `eplb_enabled`, `eplb_step_interval` | read by the rebalancer after every step |
| `eplb_window_size` | the load window is resized now, keeping its most recent steps |
| `min_data_parallel_size`, `max_data_parallel_size`, `max_experts_per_rank` | resize requests from now on are checked against them; the size serving now stays until the next resize |
| `num_redundant_experts` | the physical slot count changes with the next resize (or recovery): it sets how many slots that resize's placement has; refused (409) while one runs |
| `drain_timeout` | shrinks requested from now on without their own `drain_timeout` |
| `max_queued_requests` | arrivals from now on (0 = no bound); queued requests stay |
| `draining` | every HTTP answer from now on says `Connection: close` (the Service sends this process no new requests: a rollout moved them; kept-alive clients reconnect there) |
| `warm_spare_ranks` | the spares' upkeep starts the missing ones (on free rank slots) or stops the extra ones within a second, never during a resize or a recovery |

A PATCH names any subset of the fields, in snake_case or camelCase; it is checked whole
against the current values (min <= max, ...) and changes nothing when refused: 400 names the
field and its allowed values.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import pydantic
import pydantic_core
from pydantic import alias_generators

from moe_runtime import api_schema
from moe_runtime.elastic import coordinator as coord_mod
from moe_runtime.elastic import ops as ops_mod
from moe_runtime.elastic import rebalance, recovery
from moe_runtime.elastic import spares as spares_mod
from moe_runtime.engine import core as engine_core

log = logging.getLogger(__name__)

MAX_WINDOW_SIZE = 1_000_000
MAX_STEP_INTERVAL = 10_000_000
MAX_SIZE = 4096
MAX_REDUNDANT = 4096
MAX_DRAIN_SECONDS = 86_400
MAX_QUEUED = 1_000_000
MAX_SPARES = 64

_Int = api_schema.JsonInt


def _absent(**constraints: Any) -> Any:
    return pydantic.Field(default=None, **constraints)


class ConfigPatch(pydantic.BaseModel):
    """Body of PATCH /elastic_ep/config: the fields to change (see the module docstring)."""

    model_config = pydantic.ConfigDict(
        extra="forbid",
        alias_generator=alias_generators.to_camel,
        validate_by_name=True,
        validate_by_alias=True,
    )

    # None defaults mark a field as not given; only max_experts_per_rank takes null (no limit).
    eplb_enabled: pydantic.StrictBool = _absent()
    eplb_window_size: _Int = _absent(ge=1, le=MAX_WINDOW_SIZE)
    eplb_step_interval: _Int = _absent(ge=1, le=MAX_STEP_INTERVAL)
    min_data_parallel_size: _Int = _absent(ge=1, le=MAX_SIZE)
    max_data_parallel_size: _Int = _absent(ge=1, le=MAX_SIZE)
    max_experts_per_rank: _Int | None = _absent(ge=1, le=1_000_000, description="null: no limit")
    num_redundant_experts: _Int = _absent(ge=0, le=MAX_REDUNDANT)
    drain_timeout: _Int = _absent(ge=0, le=MAX_DRAIN_SECONDS, description="seconds")
    max_queued_requests: _Int = _absent(ge=0, le=MAX_QUEUED, description="0: no bound")
    warm_spare_ranks: _Int = _absent(ge=0, le=MAX_SPARES)
    draining: pydantic.StrictBool = _absent()

    @pydantic.model_validator(mode="before")
    @classmethod
    def _one_name_per_field(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, field in cls.model_fields.items():
            if field.alias and field.alias != name and name in data and field.alias in data:
                problem = pydantic_core.PydanticCustomError(
                    "duplicate_field",
                    "give {name} or {alias}, not both",
                    {"name": name, "alias": field.alias},
                )
                raise pydantic_core.ValidationError.from_exception_data(
                    cls.__name__, [{"type": problem, "loc": (name,), "input": data[name]}]
                )
        return data


class Config(pydantic.BaseModel):
    """What GET and PATCH /elastic_ep/config answer: every field's value now."""

    eplb_enabled: bool
    eplb_window_size: int
    eplb_step_interval: int
    min_data_parallel_size: int
    max_data_parallel_size: int
    max_experts_per_rank: int | None
    num_redundant_experts: int
    drain_timeout: float
    max_queued_requests: int
    warm_spare_ranks: int
    draining: bool = pydantic.Field(
        default=False, description="Answers say Connection: close (a rollout drains it)."
    )
    num_physical_experts: int = pydantic.Field(description="Physical expert slots serving now.")
    pending: list[str] = pydantic.Field(
        description="Fields set but not in effect yet: they apply with the next resize."
    )


class InvalidConfig(ValueError):
    """A PATCH that is refused; `param` names the field, `status_code` the HTTP status."""

    def __init__(self, message: str, *, param: str | None, status_code: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status_code = status_code


class LiveSettings:
    """Reads and applies the live settings over the pieces of a serving process."""

    def __init__(
        self,
        *,
        coordinator: coord_mod.Coordinator,
        engine: engine_core.Engine,
        ops: ops_mod.EngineResizeOps,
        rebalancer: rebalance.Rebalancer,
        recovery: recovery.Recovery,
        spares: spares_mod.SparePool | None = None,
    ) -> None:
        self.spares = spares
        self.coordinator = coordinator
        self.engine = engine
        self.ops = ops
        self.rebalancer = rebalancer
        self.recovery = recovery
        self._lock = threading.Lock()

    def get(self) -> dict[str, Any]:
        config, limits = self.rebalancer.config, self.coordinator.limits
        serving = self.ops.ctx.serving
        wanted = config.num_physical_for(limits.num_experts, serving.num_ranks)
        physical = serving.placement.num_physical
        return Config(
            eplb_enabled=config.eplb_enabled,
            eplb_window_size=self.rebalancer.load.window.window_size,
            eplb_step_interval=config.eplb_step_interval,
            min_data_parallel_size=limits.min_size,
            max_data_parallel_size=limits.max_size,
            max_experts_per_rank=limits.max_experts_per_rank,
            num_redundant_experts=config.num_redundant_experts,
            drain_timeout=self.coordinator.drain_timeout,
            max_queued_requests=self.engine.queue.max_queued or 0,
            warm_spare_ranks=self.spares.size if self.spares is not None else 0,
            draining=self.engine.draining,
            num_physical_experts=physical,
            pending=["num_redundant_experts"] if wanted != physical else [],
        ).model_dump()

    def patch(self, patch: ConfigPatch) -> dict[str, Any]:
        """Apply `patch` (all of it, or nothing: InvalidConfig) and return the new values."""
        given = patch.model_dump(exclude_unset=True)
        with self._lock:
            if self.spares is None and given.get("warm_spare_ranks"):
                raise InvalidConfig(
                    "this process keeps no warm spare ranks", param="warm_spare_ranks"
                )
            config, limits = self.rebalancer.config, self.coordinator.limits
            new_limits = dataclasses.replace(
                limits,
                min_size=given.get("min_data_parallel_size", limits.min_size),
                max_size=given.get("max_data_parallel_size", limits.max_size),
                max_experts_per_rank=given.get("max_experts_per_rank", limits.max_experts_per_rank),
                num_redundant_experts=given.get(
                    "num_redundant_experts", limits.num_redundant_experts
                ),
            )
            if new_limits.min_size > new_limits.max_size:
                param = (
                    "min_data_parallel_size"
                    if "min_data_parallel_size" in given
                    else "max_data_parallel_size"
                )
                raise InvalidConfig(
                    f"min_data_parallel_size ({new_limits.min_size}) must be <= "
                    f"max_data_parallel_size ({new_limits.max_size})",
                    param=param,
                )
            spares = given.get(
                "warm_spare_ranks", self.spares.size if self.spares is not None else 0
            )
            if spares > new_limits.max_size:
                raise InvalidConfig(
                    f"warm_spare_ranks ({spares}) must be <= max_data_parallel_size "
                    f"({new_limits.max_size}): a grow never uses more",
                    param=(
                        "warm_spare_ranks"
                        if "warm_spare_ranks" in given
                        else "max_data_parallel_size"
                    ),
                )
            redundant = given.get("num_redundant_experts", config.num_redundant_experts)
            if redundant != config.num_redundant_experts and self.coordinator.is_scaling:
                raise InvalidConfig(
                    "num_redundant_experts cannot change while a resize or recovery runs; "
                    "retry when it ends",
                    param="num_redundant_experts",
                    status_code=409,
                )
            new_config = dataclasses.replace(
                config,
                eplb_enabled=given.get("eplb_enabled", config.eplb_enabled),
                eplb_step_interval=given.get("eplb_step_interval", config.eplb_step_interval),
                eplb_window_size=given.get("eplb_window_size", config.eplb_window_size),
                num_redundant_experts=redundant,
            )
            if "eplb_window_size" in given:
                self.rebalancer.load.set_window_size(given["eplb_window_size"])
            # One frozen config shared by the resizes and recoveries (their context) and EPLB.
            self.ops.ctx.config = self.rebalancer.config = new_config
            self.coordinator.set_limits(new_limits)
            if "drain_timeout" in given:
                self.coordinator.drain_timeout = float(given["drain_timeout"])
            if "max_queued_requests" in given:
                self.engine.queue.set_max_queued(given["max_queued_requests"] or None)
            if self.spares is not None and "warm_spare_ranks" in given:
                self.spares.set_size(given["warm_spare_ranks"])
            if "draining" in given:
                self.engine.draining = bool(given["draining"])
        if given:
            log.info("live settings changed: %s", given)
        return self.get()
