"""Container environments as a kubelet builds them, for the local KubeRay stand-in: ``env`` values
with ``$(VAR)`` expansion, ``valueFrom`` (``secretKeyRef``, ``configMapKeyRef``, ``fieldRef``) and
``envFrom``, read from the API server."""

from __future__ import annotations

import base64
import dataclasses
import logging
import re
from collections.abc import Mapping
from typing import Any

from e2e.local import kubeapi, podspec

log = logging.getLogger(__name__)


class EnvNotReady(Exception):
    """A container's env refers to a Secret/ConfigMap (key) that does not exist yet."""


@dataclasses.dataclass(frozen=True)
class PodRef:
    """What ``fieldRef`` may ask about a pod."""

    namespace: str
    name: str
    uid: str = ""


class EnvResolver:
    """Resolves container environments against one API server."""

    def __init__(self, kube: kubeapi.Kube) -> None:
        self.kube = kube

    def container_env(
        self, base: Mapping[str, str], container: dict[str, Any], *, pod: PodRef
    ) -> dict[str, str]:
        """``base`` plus the container's ``envFrom`` and ``env``, as a kubelet builds them.

        Raises ``EnvNotReady`` while a Secret/ConfigMap (key) it needs does not exist."""
        env = dict(base)
        resolved: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix") or ""
            if "secretRef" in source:
                data = self._object_data(pod.namespace, "secrets", source["secretRef"], decode=True)
            else:
                data = self._object_data(
                    pod.namespace, "configmaps", source.get("configMapRef") or {}, decode=False
                )
            resolved.update({f"{prefix}{k}": v for k, v in data.items()})
        for item in container.get("env") or []:
            name = item["name"]
            if "valueFrom" not in item:
                resolved[name] = podspec.expand_vars(
                    str(item.get("value") or ""), {**env, **resolved}
                )
                continue
            value = self._value_from(pod, item["valueFrom"], name=name)
            if value is not None:
                resolved[name] = value
        env.update(resolved)
        return env

    def _value_from(self, pod: PodRef, source: dict[str, Any], *, name: str) -> str | None:
        if "secretKeyRef" in source or "configMapKeyRef" in source:
            secret = "secretKeyRef" in source
            ref = source["secretKeyRef" if secret else "configMapKeyRef"]
            kind = "secrets" if secret else "configmaps"
            try:
                data = self._object_data(pod.namespace, kind, ref, decode=secret)
            except EnvNotReady:
                if ref.get("optional"):
                    return None
                raise
            if ref["key"] not in data:
                if ref.get("optional"):
                    return None
                raise EnvNotReady(f"env {name}: key {ref['key']!r} not in {kind} {ref.get('name')}")
            return data[ref["key"]]
        if "fieldRef" in source:
            path = source["fieldRef"].get("fieldPath", "")
            fields = {
                "metadata.name": pod.name,
                "metadata.namespace": pod.namespace,
                "metadata.uid": pod.uid,
                "status.podIP": podspec.LOOPBACK,
                "status.hostIP": podspec.LOOPBACK,
                "status.podIPs": podspec.LOOPBACK,
                "spec.nodeName": podspec.NODE_NAME,
                "spec.serviceAccountName": "default",
            }
            if path in fields:
                return fields[path]
            match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
            if match:
                pod_obj = self.kube.get(f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}") or {}
                return str(
                    (pod_obj.get("metadata", {}).get(match.group(1)) or {}).get(match.group(2), "")
                )
            log.warning(
                "pod %s/%s: env %s: fieldPath %s not supported", pod.namespace, pod.name, name, path
            )
            return ""
        if "resourceFieldRef" in source:
            return "0"
        return None

    def _object_data(
        self, namespace: str, kind: str, ref: dict[str, Any], *, decode: bool
    ) -> dict[str, str]:
        name = ref.get("name", "")
        obj = self.kube.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}")
        if obj is None:
            if ref.get("optional"):
                return {}
            raise EnvNotReady(f"{kind} {namespace}/{name} not found")
        data = dict(obj.get("data") or {})
        if decode:
            return {k: base64.b64decode(v).decode() for k, v in data.items()}
        return {k: str(v) for k, v in data.items()}
