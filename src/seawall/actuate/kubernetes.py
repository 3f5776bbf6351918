"""The Kubernetes actuator: restart = delete the pod; cordon = unschedulable + taint + Event.

Owns the API calls (through the official asyncio client, `kubernetes_asyncio`) that carry
out the fleet monitor's decisions on pods and nodes. The Deployment's ReplicaSet brings a
deleted pod back, so "restart" needs no other verb; a cordoned node keeps its running
pods (we only stop new scheduling) and gets a taint so that schedulers which ignore
`unschedulable` for tolerating pods (DaemonSets) still see why.

Must not decide: when to restart or cordon is the monitor's (and `seawall.policy`'s) call.

One actor. Every pod delete carries the pod's uid as a precondition
(`DeleteOptions.preconditions.uid`, as the Kubernetes controllers send it): the uid from
EndpointSlice discovery (the endpoint's targetRef) or from the pod found by its IP. A
delete that arrives after the pod was already replaced (its name now belongs to a new
pod, a StatefulSet's way) is refused with 409 by the API server, so a late or second
actor can never kill the replacement while it loads. Such a refusal restarts nothing.

Request shapes follow the Kubernetes API reference (core/v1): DELETE
/api/v1/namespaces/{ns}/pods/{name} with a DeleteOptions body; PATCH /api/v1/nodes/{name}
as a strategic merge patch (what `kubectl cordon` sends); POST
/api/v1/namespaces/{ns}/events with an Event whose involvedObject is the Node.
"""

from __future__ import annotations

import logging
import secrets
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from seawall import clock
from seawall.actuate.base import Evidence, ReplicaRef
from seawall.policy.ledger import names_a_node

log = logging.getLogger(__name__)

TAINT_KEY = "seawall.io/hardware"
TAINT_VALUE = "suspect"
TAINT_EFFECT = "NoSchedule"
CORDON_REASON = "SeawallCordon"
UNCORDON_REASON = "SeawallUncordon"
REPORTING_COMPONENT = "seawall.io/fleet-monitor"
# Node events are namespaced objects; `kubectl describe node` looks for them in default.
EVENT_NAMESPACE = "default"
PATCH_ATTEMPTS = 3  # optimistic concurrency: retry when someone else changed the node


class KubernetesActuator:
    """Acts on pods and nodes through the API server.

    `KubernetesActuator(api_client)` takes a ready `kubernetes_asyncio.client.ApiClient`
    (tests point one at a loopback server); `await KubernetesActuator.from_environment()`
    builds one from the in-cluster service account, or ~/.kube/config outside a cluster.
    """

    name = "kubernetes"

    def __init__(self, api_client: Any, default_namespace: str = "default") -> None:
        from kubernetes_asyncio import client

        self._api_client = api_client
        self._core = client.CoreV1Api(api_client)
        self._client = client
        self.default_namespace = default_namespace

    @classmethod
    async def from_environment(cls, default_namespace: str = "default") -> KubernetesActuator:
        from kubernetes_asyncio import client
        from kubernetes_asyncio import config as kube_config

        config: Any = kube_config  # the client's loaders are untyped
        try:
            config.load_incluster_config()
        except config.ConfigException:
            await config.load_kube_config()
        return cls(client.ApiClient(), default_namespace)

    async def restart(self, replica: ReplicaRef, reason: str) -> bool:
        """Delete the pod with its normal grace period; its ReplicaSet starts a new one.
        False when no pod was found for the replica (nothing restarted)."""
        return await self._delete_pod(replica, grace_s=None, reason=reason)

    async def stop(self, replica: ReplicaRef, grace_s: float) -> None:
        await self._delete_pod(replica, grace_s=grace_s, reason="stop")

    async def cordon(self, node: str, evidence: Evidence) -> None:
        if not names_a_node(node):
            # A replica found without its node (DNS discovery): there is no Node object
            # to mark; the monitor keeps the replica itself out of routing.
            log.warning("not cordoning %s: no Kubernetes node is known for it", node)
            return
        taint = {"key": TAINT_KEY, "value": TAINT_VALUE, "effect": TAINT_EFFECT}
        uid = await self._patch_node(node, unschedulable=True, add_taint=taint)
        message = "; ".join(evidence.reasons) or "cordoned by seawall"
        if evidence.restarts:
            message += f" ({len(evidence.restarts)} restarts: " + ", ".join(
                f"{replica}: {why}" for _, replica, why in evidence.restarts
            )
            message += ")"
        await self._event(node, uid, CORDON_REASON, message, "Warning")

    async def uncordon(self, node: str) -> None:
        if not names_a_node(node):
            return
        uid = await self._patch_node(node, unschedulable=False, add_taint=None)
        await self._event(node, uid, UNCORDON_REASON, "uncordoned by seawall", "Normal")

    async def close(self) -> None:
        await self._api_client.close()

    async def _delete_pod(self, replica: ReplicaRef, grace_s: float | None, reason: str) -> bool:
        namespace = replica.namespace or self.default_namespace
        pod, uid = replica.pod, replica.uid
        if pod is None:
            pod, uid = await self._pod_by_ip(replica, namespace)
        if pod is None:
            log.warning("no pod found for replica %s (%s)", replica.replica_id, replica.url)
            return False
        c = self._client
        body = c.V1DeleteOptions(
            grace_period_seconds=None if grace_s is None else max(0, int(grace_s)),
            preconditions=c.V1Preconditions(uid=uid) if uid else None,
        )
        log.info("deleting pod %s/%s (%s): %s", namespace, pod, replica.replica_id, reason)
        try:
            await self._core.delete_namespaced_pod(pod, namespace, body=body)
        except c.ApiException as exc:
            if exc.status == 409 and uid:
                log.warning(
                    "not deleting pod %s/%s: it is no longer the pod %s was (uid %s); "
                    "it was replaced already",
                    namespace,
                    pod,
                    replica.replica_id,
                    uid,
                )
                return False
            if exc.status != 404:  # already gone is what we wanted
                raise
        return True

    async def _pod_by_ip(
        self, replica: ReplicaRef, namespace: str
    ) -> tuple[str | None, str | None]:
        """Replicas found through the headless Service are known by IP only: the pod
        there now, with its uid (the delete must reach that pod and no later one)."""
        host = urlsplit(replica.url).hostname
        if not host:
            return None, None
        pods = await self._core.list_namespaced_pod(
            namespace, field_selector=f"status.podIP={host}"
        )
        found = [p.metadata for p in pods.items if p.metadata is not None]
        return (found[0].name, found[0].uid) if found else (None, None)

    async def _patch_node(
        self, node: str, unschedulable: bool, add_taint: dict[str, str] | None
    ) -> str | None:
        """Set `spec.unschedulable` and our taint; returns the node's uid for the Event.

        Node taints have no merge key, so a strategic merge patch replaces the whole
        list: read the node, keep everyone else's taints, and send the resourceVersion
        we read so that a concurrent change makes the server answer 409 and we retry.
        """
        for attempt in range(PATCH_ATTEMPTS):
            current = await self._core.read_node(node)
            taints = [
                {k: v for k, v in t.to_dict().items() if v is not None and k != "time_added"}
                for t in (current.spec.taints or [])
                if t.key != TAINT_KEY
            ]
            if add_taint is not None:
                taints.append(add_taint)
            body = {
                "metadata": {"resourceVersion": current.metadata.resource_version},
                "spec": {"unschedulable": unschedulable, "taints": taints},
            }
            try:
                await self._core.patch_node(node, body)
                uid: str | None = current.metadata.uid
                return uid
            except self._client.ApiException as exc:
                if exc.status != 409 or attempt == PATCH_ATTEMPTS - 1:
                    raise
        return None  # unreachable: the last attempt raises

    async def _event(
        self, node: str, uid: str | None, reason: str, message: str, type_: str
    ) -> None:
        now = datetime.fromtimestamp(clock.wall(), tz=UTC)
        c = self._client
        event = c.CoreV1Event(
            metadata=c.V1ObjectMeta(
                name=f"{node}.{secrets.token_hex(8)}", namespace=EVENT_NAMESPACE
            ),
            involved_object=c.V1ObjectReference(api_version="v1", kind="Node", name=node, uid=uid),
            reason=reason,
            message=message[:1024],
            type=type_,
            source=c.V1EventSource(component=REPORTING_COMPONENT),
            reporting_component=REPORTING_COMPONENT,
            reporting_instance=REPORTING_COMPONENT,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            await self._core.create_namespaced_event(EVENT_NAMESPACE, event)
        except c.ApiException as exc:
            # The cordon itself stood; a missing Event only loses the explanation.
            log.warning("could not post %s event for node %s: %s", reason, node, exc.status)
