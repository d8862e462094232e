"""The device mesh of one data-parallel rank (``tensorParallelSize`` × ``pipelineParallelSize``)
and what its worker pod must offer it: the CRD's CEL rules and their Python twin.

One worker pod per DP rank: the pod holds the rank's T × P devices (README.md, "The
MoEDeployment, field by field"). On ``nvidia.com/gpu`` the operator sets the pod's GPUs to
T × P, so a ``ray.workerResources`` that names another GPU count is a mistake, refused; on
``cpu`` a CPU request or limit that is given must hold T × P cores (one per rank actor). Both
checks start at T × P > 1 (:data:`FIT_RULES`).
"""

from __future__ import annotations

import decimal
import re
from collections.abc import Mapping
from typing import Final, Union

import pydantic

#: Bounds of ``tensorParallelSize`` and ``pipelineParallelSize`` (a node's GPUs at most).
MAX_TENSOR_PARALLEL_SIZE: Final = 8
MAX_PIPELINE_PARALLEL_SIZE: Final = 8

GPU: Final = "nvidia.com/gpu"
CPU: Final = "cpu"

#: Devices of one DP rank, in CEL (both fields have defaults, so they are always set).
_DEVICES: Final = "(self.tensorParallelSize * self.pipelineParallelSize)"
_RESOURCES: Final = "self.ray.workerResources"

GPUS_MUST_MATCH: Final = (
    "ray.workerResources nvidia.com/gpu must equal tensorParallelSize x pipelineParallelSize "
    "(one worker pod per data-parallel rank holds its devices; leave it out and the operator "
    "sets it)"
)
CPUS_TOO_FEW: Final = (
    "ray.workerResources cpu must be at least tensorParallelSize x pipelineParallelSize "
    "cores (one worker pod per data-parallel rank runs one rank actor per device)"
)


def _present(part: str, key: str) -> str:
    return f"has({_RESOURCES}.{part}) && '{key}' in {_RESOURCES}.{part}"


def _value(part: str, key: str) -> str:
    return f"{_RESOURCES}.{part}['{key}']"


# An int-or-string value is CEL's dyn, whose estimated size is the whole request: no string()
# of it (the API server refuses such a rule as too costly), an int compared as an int, a string
# read by the quantity library.
def _gpus_equal(part: str) -> str:
    v = _value(part, GPU)
    return (
        f"(!({_present(part, GPU)}) || (type({v}) == int ? {v} == {_DEVICES} : "
        f"(isQuantity({v}) && quantity({v}).isInteger() && "
        f"quantity({v}).asInteger() == {_DEVICES})))"
    )


def _cpus_enough(part: str) -> str:
    v = _value(part, CPU)
    return (
        f"(!({_present(part, CPU)}) || (type({v}) == int ? {v} >= {_DEVICES} : "
        f"(!isQuantity({v}) || quantity({v}).asApproximateFloat() >= double({_DEVICES}))))"
    )


_GIVEN: Final = f"{_DEVICES} > 1 && has(self.ray) && has({_RESOURCES}) && has(self.ray.accelerator)"

#: Spec-level rules: a worker pod's resources, where the user sets them, fit the rank's mesh.
#: They apply from T x P > 1 on: a spec of one device per rank reads as it always did (a
#: fraction of a core; a GPU count the operator overwrites with 1), so no stored deployment
#: turns invalid under a new operator. A CPU quantity that does not parse is left to the API
#: server's Pod validation.
FIT_RULES: Final[list[pydantic.JsonValue]] = [
    {
        "rule": f"!({_GIVEN}) || self.ray.accelerator != '{GPU}' || "
        f"({_gpus_equal('requests')} && {_gpus_equal('limits')})",
        "message": GPUS_MUST_MATCH,
        "fieldPath": ".ray.workerResources",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": f"!({_GIVEN}) || self.ray.accelerator != '{CPU}' || "
        f"({_cpus_enough('requests')} && {_cpus_enough('limits')})",
        "message": CPUS_TOO_FEW,
        "fieldPath": ".ray.workerResources",
        "reason": "FieldValueInvalid",
    },
]

#: A Kubernetes quantity: a signed decimal and a binary-SI, decimal-SI or exponent suffix.
_QUANTITY: Final = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$"
)
_BINARY: Final = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL: Final = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(value: Union[int, str]) -> decimal.Decimal | None:
    """The value of a Kubernetes quantity (``"500m"`` -> 0.5, ``"2Gi"``, ``4``); ``None`` when
    it is not one (CEL's ``isQuantity`` false)."""
    match = _QUANTITY.match(str(value).strip())
    if match is None:
        return None
    number, suffix = decimal.Decimal(match.group(1)), match.group(2) or ""
    if suffix in _BINARY:
        return number * decimal.Decimal(1024) ** _BINARY[suffix]
    if suffix in _DECIMAL:
        return number.scaleb(_DECIMAL[suffix])
    if suffix:
        return number.scaleb(int(suffix[1:]))
    return number


def check_fit(
    *,
    devices: int,
    accelerator: str,
    requests: Mapping[str, Union[int, str]] | None,
    limits: Mapping[str, Union[int, str]] | None,
) -> None:
    """:data:`FIT_RULES` in Python (``ValueError`` with the same message, and the values)."""
    if devices == 1:
        return
    for part in (requests or {}, limits or {}):
        if accelerator == GPU and GPU in part:
            gpus = parse_quantity(part[GPU])
            if gpus is None or gpus != devices:
                raise ValueError(f"{GPUS_MUST_MATCH} (got {part[GPU]!r}, want {devices})")
        if accelerator == CPU and CPU in part:
            cores = parse_quantity(part[CPU])
            if cores is not None and cores < devices:
                raise ValueError(f"{CPUS_TOO_FEW} (got {part[CPU]!r}, want >= {devices})")
