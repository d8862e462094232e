"""A small dict-in, dict-out client of the Kubernetes REST API for the local stand-ins.

The generated clients of ``kubernetes`` 37 validate bodies against pydantic models; the stand-in
for KubeRay handles custom resources and pod templates it does not own, so it speaks plain JSON
through the client's transport (authentication, TLS and the kubeconfig stay the client's job).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client import exceptions as k8s_exceptions

ApiError = k8s_exceptions.ApiException

PATCH_TYPES = {
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
    "strategic": "application/strategic-merge-patch+json",
}


class Kube:
    """Plain JSON requests to one API server, authenticated as the kubeconfig says."""

    def __init__(self, kubeconfig: str | Path, *, timeout_s: float = 10.0) -> None:
        self._client: k8s_client.ApiClient = k8s_config.new_client_from_config(
            config_file=str(kubeconfig)
        )  # type: ignore[no-untyped-call]
        self._timeout_s = timeout_s

    def close(self) -> None:
        self._client.close()  # type: ignore[no-untyped-call]

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One request; the decoded JSON answer. Raises ``ApiError`` (with ``.status``)."""
        serialized = self._client.param_serialize(
            method.upper(),
            path,
            query_params=list(query),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self._client.call_api(*serialized, _request_timeout=self._timeout_s)
        response.read()  # type: ignore[no-untyped-call]
        if not 200 <= response.status <= 299:
            raise ApiError(status=response.status, reason=response.reason, http_resp=response)
        data = response.data
        if not data:
            return {}
        decoded: dict[str, Any] = json.loads(data)
        return decoded

    def get(self, path: str) -> dict[str, Any] | None:
        """The object at ``path``, or None when it does not exist."""
        try:
            return self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, path: str, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else []
        items: list[dict[str, Any]] = self.request("GET", path, query=query).get("items") or []
        return items

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body=dict(body))

    def patch(self, path: str, body: Any, *, kind: str = "merge") -> dict[str, Any]:
        """A patch of ``kind`` merge (RFC 7386), json (RFC 6902) or strategic."""
        return self.request("PATCH", path, body=body, content_type=PATCH_TYPES[kind])

    def delete(self, path: str, *, grace_period_seconds: int | None = None) -> bool:
        """Delete; False when it was already gone."""
        query = []
        if grace_period_seconds is not None:
            query.append(("gracePeriodSeconds", str(grace_period_seconds)))
        try:
            self.request("DELETE", path, query=query)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True
