"""What a multi-node trainer needs beyond one pod: a rank 0 that is pod 0, NCCL's env, RDMA, and a
termination grace long enough for the last checkpoint. Pure functions of the spec, used by
asyncrl.operator.builders.trainer_statefulset (docs/operator.md, "Multi-node trainer").
"""

from __future__ import annotations

import math
import re
from typing import Any

from asyncrl.api.spec import AsyncRLJob, NcclSettings, RdmaSettings
from asyncrl.operator import names as N

Obj = dict[str, Any]

ENV_NODE_RANK = "ASYNCRL_NODE_RANK"
"""torchrun's --node-rank: the StatefulSet ordinal, from the `apps.kubernetes.io/pod-index` label
(set on StatefulSet pods since Kubernetes 1.28)."""
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"

GRACE_FLOOR_SECONDS = 120
"""The least a trainer pod gets to stop: the grace of a small model (and of one whose size is unknown)."""
CHECKPOINT_WRITE_BYTES_PER_SECOND = 200 * 2**20
"""The stated write bandwidth of the shared volume the derived grace assumes: 200 MiB/s, a modest
RWX volume (NFS, a cloud file share). Faster storage only makes the derived grace generous."""
GRACE_MARGIN_SECONDS = 60
"""Added to the write time: the step in flight finishes first, then the processes exit."""
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_COPIES = 4
"""What the last checkpoint writes per parameter, in the model's dtype: the weights and AdamW's two
moments (trainer/state/checkpoint.py: model.pt + optimizer.pt), plus the published weights of the last step."""
_SIZE_IN_NAME = re.compile(r"(?<![A-Za-z0-9.])(?:(\d+)x)?(\d+(?:\.\d+)?)([BbMm])(?![A-Za-z0-9])")


def parameter_estimate(model_path: str) -> float | None:
    """Parameters the model's name announces ("Qwen2.5-1.5B-Instruct" -> 1.5e9, "SmolLM2-135M" ->
    1.35e8, "Mixtral-8x7B" -> 5.6e10, an over-estimate; the largest figure when several appear), or
    None when it names none."""
    sizes = [int(experts or 1) * float(n) * (1e9 if unit in "Bb" else 1e6)
             for experts, n, unit in _SIZE_IN_NAME.findall(model_path)]
    return max(sizes) if sizes else None


def termination_grace_seconds(job: AsyncRLJob) -> int:
    """spec.trainer.terminationGracePeriodSeconds, else the time to write the last checkpoint of a
    model of the estimated size at CHECKPOINT_WRITE_BYTES_PER_SECOND plus a margin, at least
    GRACE_FLOOR_SECONDS (the grace the trainer always had). Kubernetes kills the pod when it ends,
    checkpoint written or not."""
    explicit = job.spec.trainer.termination_grace_period_seconds
    if explicit is not None:
        return explicit
    params = parameter_estimate(job.spec.model.path)
    if params is None:
        return GRACE_FLOOR_SECONDS
    write = params * _DTYPE_BYTES[job.spec.model.dtype] * _COPIES / CHECKPOINT_WRITE_BYTES_PER_SECOND
    return max(GRACE_FLOOR_SECONDS, math.ceil(write) + GRACE_MARGIN_SECONDS)


def rank0_host(job_name: str, namespace: str) -> str:
    """The stable DNS name of trainer pod 0 (global rank 0) through the trainer's headless Service:
    where torchrun's static rendezvous meets and, with trainer.weightTransport collective, where the
    engines dial the weight group's store. Resolves before the pod is Ready (publishNotReadyAddresses)."""
    sts = N.trainer(job_name)
    return f"{sts}-0.{sts}.{namespace}.svc"


def node_rank_env() -> Obj:
    """The pod's ordinal as ASYNCRL_NODE_RANK (downward API), which torchrun's --node-rank expands."""
    return {"name": ENV_NODE_RANK, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}}


def nccl_env(nccl: NcclSettings | None, taken: set[str]) -> list[Obj]:
    """The env vars of spec.trainer.nccl, except those in `taken` (the podTemplate's env wins)."""
    if nccl is None:
        return []
    values: dict[str, str | None] = {
        "NCCL_SOCKET_IFNAME": nccl.socket_ifname,
        "GLOO_SOCKET_IFNAME": nccl.socket_ifname,  # torch's gloo group (CPU collectives) binds the same way
        "NCCL_IB_HCA": nccl.ib_hca,
        "NCCL_IB_DISABLE": None if nccl.ib_disable is None else str(int(nccl.ib_disable)),
        "NCCL_DEBUG": nccl.debug,
    }
    return [{"name": k, "value": v} for k, v in values.items() if v is not None and k not in taken]


def rdma_resources(rdma: RdmaSettings | None, resources: Obj) -> Obj:
    """`resources` with the RDMA device request added (extended resources: limits, which imply requests)."""
    if rdma is None or rdma.resource_name is None:
        return resources
    return {**resources, "limits": {**resources.get("limits", {}), rdma.resource_name: str(rdma.count)}}


def rdma_capabilities(rdma: RdmaSettings | None, security: Obj) -> Obj:
    """The container securityContext with IPC_LOCK added when RDMA asks for it (every other capability
    stays dropped)."""
    if rdma is None or not rdma.ipc_lock:
        return security
    return {**security, "capabilities": {**security.get("capabilities", {}), "add": ["IPC_LOCK"]}}
