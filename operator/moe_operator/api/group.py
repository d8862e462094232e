"""Names of the MoEDeployment API group, kind and the labels the operator puts on children."""

from __future__ import annotations

from typing import Final

GROUP: Final = "elasticmoe.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "MoEDeployment"
PLURAL: Final = "moedeployments"
SINGULAR: Final = "moedeployment"
SHORT_NAMES: Final = ("moed",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

#: Label on every child (and in ``status.selector``) naming the owning MoEDeployment.
LABEL_DEPLOYMENT: Final = f"{GROUP}/deployment"
#: Label saying which part of the deployment an object is (``head``, ``worker``, ``api``, ...).
LABEL_COMPONENT: Final = f"{GROUP}/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "elastic-moe"

#: Annotation overriding the URL the operator uses to reach the runtime's admin API.
ANNOTATION_RUNTIME_URL: Final = f"{GROUP}/runtime-url"
#: Annotation a local KubeRay stand-in puts on a RayCluster: where its runtime listens.
ANNOTATION_LOCAL_ENDPOINT: Final = f"{GROUP}/local-endpoint"
#: Annotation on the RayCluster's head pod template: the ``--data-parallel-size`` the head's
#: runtime starts at, kept from the RayCluster's creation on (a resize never rewrites the head).
ANNOTATION_HEAD_SIZE: Final = f"{GROUP}/initial-data-parallel-size"
#: Annotations on the RayCluster's head pod template: the tensor-parallel and pipeline-parallel
#: sizes its runtime serves (absent: 1). ``status.tensorParallelSize`` / ``pipelineParallelSize``.
ANNOTATION_TENSOR_PARALLEL_SIZE: Final = f"{GROUP}/tensor-parallel-size"
ANNOTATION_PIPELINE_PARALLEL_SIZE: Final = f"{GROUP}/pipeline-parallel-size"
#: The template revision (``plan.revision``) a RayCluster's pods are made from: on the
#: RayCluster (annotation) and on its pod templates (label).
REVISION: Final = f"{GROUP}/revision"
