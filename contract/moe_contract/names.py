"""Names and constants both sides rely on: the runtime's port and routes, the Ray resource
that marks a rank slot, the environment the operator gives the Ray containers, and Ray's kill
timeout the runtime's fencing counts on."""

from __future__ import annotations

from typing import Final

#: The port ``moe-runtime serve`` listens on (its default; the operator passes it, probes it
#: and points the deployment's Service at it).
RUNTIME_PORT: Final = 8000
#: Liveness (200 while the process and its loop run, a resize included) and readiness (200
#: once a step path serves) of the runtime (docs/RUNTIME.md); the head's probes.
HEALTH_PATH: Final = "/health"
READY_PATH: Final = "/ready"
#: The admin routes the operator calls (docs/RUNTIME.md).
STATUS_PATH: Final = "/elastic_ep/status"
SCALE_PATH: Final = "/scale_elastic_ep"
CONFIG_PATH: Final = "/elastic_ep/config"
IS_SCALING_PATH: Final = "/is_scaling_elastic_ep"

#: Custom Ray resource a worker pod offers (``ray start --resources``): one slot per device of
#: the DP rank it holds (tensor x pipeline parallel size; one worker pod per DP rank); the
#: runtime places every rank actor on one slot.
RANK_RESOURCE: Final = "moe_rank"

#: The pod a rank runs in, given to every Ray container by the operator (downward API); the
#: runtime reports it per rank (``ranks[].pod``) and the operator names exactly those pods in
#: ``workersToDelete`` after a shrink.
POD_NAME_ENV: Final = "MOE_POD_NAME"

#: Ray's grace between SIGTERM and SIGKILL of a killed worker (Ray's default is 5 s). A fenced
#: (hung) rank is a stopped process that cannot exit by itself: its peers wait this long. The
#: operator sets it on every Ray container; a local Ray instance of the runtime gets it as
#: ``_system_config``.
RAY_KILL_WORKER_TIMEOUT_MS: Final = 200
RAY_KILL_WORKER_TIMEOUT_ENV: Final = "RAY_kill_worker_timeout_milliseconds"

#: The scheme of a synthetic model source (``synthetic://NAME?seed=N``): weights made from a
#: seed, no checkpoint behind them (so no dtype to read: the operator says bfloat16 on GPUs).
SYNTHETIC_SCHEME: Final = "synthetic://"
