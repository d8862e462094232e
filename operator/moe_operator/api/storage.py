"""``model.source: pvc://CLAIM/PATH`` (KServe's ``storageUri`` form): parsing and validation.

``CLAIM`` names a PersistentVolumeClaim in the deployment's namespace (a DNS-1123 subdomain);
``PATH`` is a directory inside it, relative (no leading ``/``, no ``.`` or ``..`` segment),
empty for the claim's root. The same rules are CEL rules of the CRD (:data:`CEL_RULES`) and
Python (:func:`parse_pvc`), so the API server and the operator refuse the same sources.
Where the claim is mounted and what path the runtime gets is ``plan.builders``' business.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Final

import pydantic

PVC_SCHEME: Final = "pvc://"
#: Longest PersistentVolumeClaim name the API server accepts (a DNS-1123 subdomain).
MAX_CLAIM_LENGTH: Final = 253
_CLAIM: Final = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
#: ``pvc://CLAIM``, ``pvc://CLAIM/`` or ``pvc://CLAIM/SEG/SEG...`` (segments without ``/``).
PVC_PATTERN: Final = rf"^pvc://{_CLAIM}(/[^/]+)*/?$"
#: A ``.`` or ``..`` segment anywhere in the path.
DOT_SEGMENT_PATTERN: Final = r"^pvc://[^/]*/(.*/)?\.\.?(/.*)?$"

_GUARD: Final = f"!self.startsWith('{PVC_SCHEME}') || "
CEL_RULES: Final[list[pydantic.JsonValue]] = [
    {
        "rule": _GUARD + f"self.matches('{PVC_PATTERN.replace(chr(92), chr(92) * 2)}')",
        "message": "model.source pvc://CLAIM/PATH: CLAIM must be a PersistentVolumeClaim name "
        "(lower case letters, digits, '-' and '.') and PATH a relative path inside it",
    },
    {
        "rule": _GUARD + f"!self.matches('{DOT_SEGMENT_PATTERN.replace(chr(92), chr(92) * 2)}')",
        "message": "model.source pvc://CLAIM/PATH: PATH must not contain '.' or '..' segments",
    },
]


@dataclasses.dataclass(frozen=True)
class PvcSource:
    """A checkpoint directory ``path`` (relative; ``""``: the root) on the claim ``claim``."""

    claim: str
    path: str

    @property
    def uri(self) -> str:
        return f"{PVC_SCHEME}{self.claim}/{self.path}" if self.path else PVC_SCHEME + self.claim


def is_pvc(source: str) -> bool:
    return source.startswith(PVC_SCHEME)


def parse_pvc(source: str) -> PvcSource | None:
    """The claim and path of a ``pvc://`` source; ``None`` for any other source.

    Raises ``ValueError`` naming the source and what is wrong with it (the CRD's CEL rules
    refuse the same strings)."""
    if not is_pvc(source):
        return None
    if not re.match(PVC_PATTERN, source):
        raise ValueError(
            f"model.source {source!r}: expected pvc://CLAIM/PATH with CLAIM a "
            "PersistentVolumeClaim name (lower case letters, digits, '-' and '.') and PATH a "
            "relative path inside it"
        )
    if re.match(DOT_SEGMENT_PATTERN, source):
        raise ValueError(f"model.source {source!r}: PATH must not contain '.' or '..' segments")
    claim, _, path = source[len(PVC_SCHEME) :].partition("/")
    if len(claim) > MAX_CLAIM_LENGTH:
        raise ValueError(
            f"model.source {source!r}: the claim name is longer than {MAX_CLAIM_LENGTH} characters"
        )
    return PvcSource(claim=claim, path=path.rstrip("/"))
