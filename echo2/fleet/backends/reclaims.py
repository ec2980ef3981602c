"""Telling a reclaim from a crash, from the provider's own record of why a machine ended.

An actor that vanished was either taken by the provider (a spot reclaim: expected, priced into
the activation's over-provisioning, counted in the reclaim-rate estimate), ended by us (retired
surplus, teardown), or died for another reason (a crash: a bug, a hardware retirement, an internal
error). The actor's own exit cannot tell them apart: a reclaimed machine is simply gone. The cost
report and the reclaim-rate estimate must not count a crash as a reclaim (it would teach activation
that spot is riskier than it is) nor a reclaim as a crash (it would hide real bugs), so the backend
asks the cloud:

- AWS (boto3 EC2): ``describe_instances`` keeps a terminated instance for about an hour with a
  ``StateReason``: ``Server.SpotInstanceTermination`` (or ``Server.SpotInstanceShutdown`` for a spot
  instance whose interruption behaviour is stop) is a reclaim, ``Client.UserInitiatedShutdown`` is
  someone's terminate call (ours), anything else ended is a crash. The spot request's status
  (``instance-terminated-by-price``, ``...-no-capacity`` ...) confirms a reclaim where the state
  reason was lost or is generic.
- GCP (``google-cloud-compute``): a preemption leaves a zone operation of type
  ``compute.instances.preempted`` whose ``targetLink`` names the instance; listing them (one zone,
  or every zone through the aggregated list) gives the set of reclaimed instance names.

Both take a client built by the caller (credentials, region, endpoint), so tests point them at moto
and at a loopback fake of the Compute REST API. ``cloud_end_reason`` asks them about a SkyPilot
cluster (the SkyPilot backend's default), building the default clients where none is given.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

EndReason = Literal["reclaimed", "crashed", "terminated"]

SPOT_STATE_REASONS = frozenset({"Server.SpotInstanceTermination", "Server.SpotInstanceShutdown"})
"""EC2 state-reason codes of an instance the spot market took (terminated, or stopped)."""
USER_STATE_REASONS = frozenset({"Client.UserInitiatedShutdown", "Client.UserInitiatedHibernate"})
"""Ended through the API by the account (our terminate call, or anyone's with our credentials)."""
SPOT_RECLAIM_STATUSES = frozenset({
    "instance-terminated-by-price", "instance-terminated-no-capacity",
    "instance-terminated-capacity-oversubscribed", "instance-terminated-launch-group-constraint",
    "instance-stopped-by-price", "instance-stopped-no-capacity", "instance-stopped-capacity-oversubscribed",
    "instance-hibernated-by-price", "instance-hibernated-no-capacity", "instance-hibernated-capacity-oversubscribed",
    "marked-for-termination", "marked-for-stop", "marked-for-hibernation",
})
"""Spot request status codes that mean the market took the instance (not the user, not a fault)."""
USER_SPOT_STATUSES = frozenset({"instance-terminated-by-user", "instance-stopped-by-user",
                                "request-canceled-and-instance-running"})
ENDED_STATES = frozenset({"shutting-down", "terminated", "stopping", "stopped"})
PREEMPTED_OPERATION = "compute.instances.preempted"

log = logging.getLogger("echo2.fleet")


def _spot_status(ec2_client: Any, instance: dict) -> str | None:
    """The status code of the spot request behind ``instance`` (None when it has none, or it is gone).

    The instance names its request in ``SpotInstanceRequestId``; where that is empty (moto, some
    fleet-launched instances) the request is found by its ``instance-id`` filter."""
    from botocore.exceptions import ClientError

    request_id = instance.get("SpotInstanceRequestId")
    try:
        if request_id:
            reply = ec2_client.describe_spot_instance_requests(SpotInstanceRequestIds=[request_id])
        else:
            reply = ec2_client.describe_spot_instance_requests(
                Filters=[{"Name": "instance-id", "Values": [instance["InstanceId"]]}])
    except ClientError:  # the request expired from the API, or the filter is not supported
        return None
    for request in reply.get("SpotInstanceRequests", []):
        if request_id or request.get("InstanceId") == instance["InstanceId"]:
            code = (request.get("Status") or {}).get("Code")
            if code:
                return code
    return None


def aws_instance_end_reason(ec2_client: Any, instance_id: str) -> EndReason | None:
    """Why EC2 instance ``instance_id`` ended: ``reclaimed`` (spot market), ``terminated`` (by the
    account), ``crashed`` (anything else); None while it still runs or when EC2 no longer knows it
    (a terminated instance stays visible for about an hour: ask soon after the actor is lost)."""
    from botocore.exceptions import ClientError

    try:
        reply = ec2_client.describe_instances(InstanceIds=[instance_id])
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"):
            return None
        raise
    instances = [i for r in reply.get("Reservations", []) for i in r.get("Instances", [])
                 if i.get("InstanceId") == instance_id]
    if not instances:
        return None
    instance = instances[0]
    if instance.get("State", {}).get("Name") not in ENDED_STATES:
        return None
    code = (instance.get("StateReason") or {}).get("Code", "")
    if code in SPOT_STATE_REASONS:
        return "reclaimed"
    is_spot = instance.get("InstanceLifecycle") == "spot" or bool(instance.get("SpotInstanceRequestId"))
    status = _spot_status(ec2_client, instance) if is_spot else None
    if status in SPOT_RECLAIM_STATUSES:
        return "reclaimed"
    if code in USER_STATE_REASONS or status in USER_SPOT_STATUSES:
        return "terminated"
    return "crashed"


def gcp_operations_client(*, zonal: bool, api_endpoint: str | None = None, credentials: Any = None) -> Any:
    """A REST ``ZoneOperationsClient`` (``zonal``) or ``GlobalOperationsClient`` (aggregated list over
    every zone). ``api_endpoint`` (with ``credentials``, e.g. ``AnonymousCredentials()``) points it
    elsewhere than compute.googleapis.com: tests give a loopback fake."""
    from google.cloud import compute_v1

    options = {"api_endpoint": api_endpoint} if api_endpoint else None
    cls = compute_v1.ZoneOperationsClient if zonal else compute_v1.GlobalOperationsClient
    return cls(credentials=credentials, transport="rest", client_options=options)


def _instance_name(target_link: str) -> str:
    """``.../zones/Z/instances/NAME`` -> ``NAME``."""
    return target_link.rstrip("/").rsplit("/", 1)[-1]


def gcp_preempted_instances(project: str, zone: str | None = None, client: Any = None, *,
                            api_endpoint: str | None = None, credentials: Any = None) -> set[str]:
    """Names of the instances GCP preempted in ``project``: in ``zone``, or in every zone when
    ``zone`` is None or ``"all"``. ``client`` is a ``ZoneOperationsClient`` for one zone, a
    ``GlobalOperationsClient`` for all (built from ``api_endpoint``/``credentials`` when None).

    The server filters on the operation type; the type is checked again here, so a server (or a
    fake) that ignores the filter cannot turn an insert or a delete into a reclaim."""
    from google.cloud import compute_v1

    every_zone = zone is None or zone == "all"
    if client is None:
        client = gcp_operations_client(zonal=not every_zone, api_endpoint=api_endpoint, credentials=credentials)
    flt = f'operationType="{PREEMPTED_OPERATION}"'
    if every_zone:
        pager = client.aggregated_list(request=compute_v1.AggregatedListGlobalOperationsRequest(project=project,
                                                                                                 filter=flt))
        operations = [op for _scope, scoped in pager for op in scoped.operations]
    else:
        operations = list(client.list(request=compute_v1.ListZoneOperationsRequest(project=project, zone=zone,
                                                                                   filter=flt)))
    return {_instance_name(op.target_link) for op in operations
            if op.operation_type == PREEMPTED_OPERATION and op.target_link}


def cloud_end_reason(launched: Any, name_on_cloud: str | None, *, ec2_client=None,
                     gcp_project: str | None = None, gcp_client=None) -> tuple[str, str]:
    """Ask the cloud why the instances behind a SkyPilot cluster ended (``launched``: what its launch bought,
    ``skypilot.Launched``): AWS by the EC2 tag
    SkyPilot puts on them, GCP by its preemption operations; elsewhere a vanished spot cluster is
    taken for a reclaim (no reason API), a vanished on-demand one for a crash."""
    try:
        if launched.cloud == "aws" and name_on_cloud:
            if ec2_client is None:
                import boto3

                ec2_client = boto3.client("ec2", region_name=launched.region)
            reply = ec2_client.describe_instances(
                Filters=[{"Name": "tag:skypilot-cluster-name", "Values": [name_on_cloud]}])
            ids = [i["InstanceId"] for r in reply.get("Reservations", []) for i in r.get("Instances", [])]
            reasons = {aws_instance_end_reason(ec2_client, i) for i in ids} - {None}
            for reason in ("reclaimed", "crashed", "terminated"):
                if reason in reasons:
                    return reason, f"EC2 says {reason} ({len(ids)} instance(s) tagged {name_on_cloud})"
            return "crashed", f"EC2 has no ended instance tagged {name_on_cloud}"
        if launched.cloud == "gcp" and name_on_cloud:
            if gcp_project is None:
                import google.auth

                _, gcp_project = google.auth.default()
            preempted = gcp_preempted_instances(gcp_project, None, gcp_client)
            if any(n.startswith(name_on_cloud) for n in preempted):
                return "reclaimed", "GCP preempted it (compute.instances.preempted)"
            return "crashed", "no GCP preemption operation names it"
    except Exception as exc:  # the question failed, not the actor: say so, and fall back on the market
        log.warning("could not ask %s why %s ended: %s", launched.cloud, name_on_cloud, exc)
    if launched.spot:
        return "reclaimed", f"spot instance gone ({launched.cloud} gives no reason here)"
    return "crashed", "on-demand instance gone"
