"""Per-deployment credentials, derived from the operator's own key (pure).

The runtime's admin token and the Ray cluster's token of a deployment are
``HMAC-SHA256(key, purpose, namespace, name, uid)``: the operator writes them into the
deployment's Secret once (``create``) and never needs to read that Secret back, so its RBAC
holds no ``get`` on Secrets outside its own namespace, where the key lives. A deployment
deleted and re-created under the same name has a new uid, hence new tokens. Rotating the key
changes every token: a running runtime would then refuse the operator (401) until its head
restarts with the new Secret; the key is never rotated by the operator.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Final

PURPOSE_ADMIN: Final = "admin"
PURPOSE_RAY: Final = "ray"
#: Bytes of a freshly made operator key.
KEY_BYTES: Final = 32


def derive(key: bytes, *, purpose: str, namespace: str, name: str, uid: str) -> str:
    """The token of one purpose for one deployment (URL-safe base64, 43 characters)."""
    if not key:
        raise ValueError("the operator key is empty")
    message = "\0".join((purpose, namespace, name, uid)).encode()
    mac = hmac.new(key, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
