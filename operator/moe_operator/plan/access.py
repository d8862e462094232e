"""How a deployment is reached and who may reach it (pure): the Service in front of the
runtime's API, the NetworkPolicy around its Ray pods, and its Secret of tokens. The
RayCluster itself is ``plan.builders``."""

from __future__ import annotations

from typing import Any, Final

from moe_contract import names
from moe_operator.api import group
from moe_operator.plan import builders, observe

CLUSTER_LABEL: Final = observe.CLUSTER_LABEL


def build_service(*, owner: builders.Owner, cluster: str | None = None) -> dict[str, Any]:
    """The ClusterIP Service in front of the head's runtime API (``names.RUNTIME_PORT``) of
    the RayCluster ``cluster`` (default: the first one, named after the deployment): a
    rollout moves the selector from one RayCluster's head to the other's."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": builders.metadata(
            owner=owner, name=builders.service_name(owner.name), component=builders.COMPONENT_API
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": {
                group.LABEL_DEPLOYMENT: owner.name,
                group.LABEL_COMPONENT: builders.COMPONENT_HEAD,
                CLUSTER_LABEL: cluster or builders.raycluster_name(owner.name),
            },
            "ports": [
                {
                    "name": "http",
                    "port": names.RUNTIME_PORT,
                    "targetPort": "http",
                    "protocol": "TCP",
                }
            ],
        },
    }


def network_policy_name(owner_name: str) -> str:
    return f"{owner_name}-ray"


def build_network_policy(*, owner: builders.Owner) -> dict[str, Any]:
    """Ingress to the deployment's Ray pods: anything from its own Ray pods (GCS, raylets,
    object transfers, the ranks' collectives), and the runtime's API port from anywhere (the
    Service's clients, the operator); nothing else reaches Ray's ports. Egress is left open.
    It takes effect where the cluster's network plugin enforces NetworkPolicies."""
    # Every RayCluster of the deployment (two during a rollout); each one's Ray pods only
    # talk among themselves, but the policy need not tell them apart.
    ray_pods = {
        "matchLabels": {group.LABEL_DEPLOYMENT: owner.name},
        "matchExpressions": [{"key": CLUSTER_LABEL, "operator": "Exists"}],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": builders.metadata(
            owner=owner, name=network_policy_name(owner.name), component=builders.COMPONENT_RAY
        ),
        "spec": {
            "podSelector": ray_pods,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": ray_pods}]},
                {"ports": [{"protocol": "TCP", "port": names.RUNTIME_PORT}]},
            ],
        },
    }


def build_secret(*, owner: builders.Owner, token: str, ray_token: str) -> dict[str, Any]:
    """The Secret of a deployment: the runtime's admin token and its Ray cluster's token
    (created once, never updated: see ``plan.credentials``)."""
    if not token or not ray_token:
        raise ValueError("tokens must not be empty")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": builders.metadata(
            owner=owner, name=builders.secret_name(owner.name), component=builders.COMPONENT_ADMIN
        ),
        "stringData": {builders.SECRET_TOKEN_KEY: token, builders.SECRET_RAY_TOKEN_KEY: ray_token},
    }
