"""echo2's bridge into SkyPilot, run by SkyPilot's own Python: ``<sky python> sky_bridge.py OP`` reads one JSON
request on stdin and writes one JSON answer on stdout.

SkyPilot pins click<8.2 and so holds transformers and huggingface-hub back: it never shares echo2's environment.
It lives in an environment of its own (``.venv-sky``, ``make setup``), and echo2 reaches it only through this file
(``skypilot_api.py`` runs it). So this file imports SkyPilot and the standard library, never echo2.

A task travels as data: ``{"config": <a SkyPilot task YAML mapping>, "envs": {...}, "secrets": {...},
"candidates": [<Resources keyword arguments>, ...]}`` (``candidates`` optional: the config's own ``resources``
otherwise), built here into ``sky.Task``. A failure is answered as ``{"error": {"type", "mro", "message"}}``:
the SkyPilot exception's class name, those of its bases, and its text, so the caller tells a dropped request
from a refusal as it would with SkyPilot in process. Whatever SkyPilot prints goes to stderr.

Operations (``OPS``): enabled_clouds, task (the task as SkyPilot reads it back), no_upload_config,
launch (sends the request; its request id), wait (a request's result), cancel, status, job_status, down,
jobs_launch (a managed job), accelerators (the catalog), credentials (credential files that would travel
anyway, and whether the API server is local).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys


# -- tasks and the launch config ---------------------------------------------------------------------------
def make_task(request: dict):
    """``request``'s task as ``sky.Task``: its config with envs and secrets laid over, and its candidates."""
    import sky

    task = sky.Task.from_yaml_config(request["config"], env_overrides=list((request.get("envs") or {}).items()),
                                     secrets_overrides=list((request.get("secrets") or {}).items()))
    candidates = request.get("candidates")
    if candidates:
        task.set_resources({sky.Resources(**candidate) for candidate in candidates})
    return task


def clouds_with_remote_identity() -> list[str]:
    """SkyPilot's clouds whose config has ``remote_identity`` (NO_UPLOAD keeps their credentials home)."""
    from sky.utils import registry, schemas

    sections = schemas.get_config_schema()["properties"]
    return sorted(name for name in registry.CLOUD_REGISTRY
                  if "remote_identity" in sections.get(name, {}).get("properties", {}))


def no_upload_config(aws_node_profile: str | None = None) -> dict:
    """The config override every actor launch is sent with: ``remote_identity: NO_UPLOAD`` everywhere; on AWS the
    named instance profile instead where one is given (a name uploads nothing either, and replaces the
    ``skypilot-v1`` profile SkyPilot would otherwise attach). Why: ``echo2/fleet/backends/skypilot_trust.py``."""
    config = {cloud: {"remote_identity": "NO_UPLOAD"} for cloud in clouds_with_remote_identity()}
    if aws_node_profile:
        config["aws"] = {"remote_identity": aws_node_profile}
    return config


@contextlib.contextmanager
def launch_config(aws_node_profile: str | None = None):
    """SDK requests made inside carry ``no_upload_config`` merged over the client's config (the SDK sends the
    client's config with each request, and the API server applies it). SkyPilot keeps that config in one global
    of the process: each bridge call is a process of its own, so concurrent launches never share it."""
    from sky import skypilot_config

    with skypilot_config.override_skypilot_config(no_upload_config(aws_node_profile)):
        yield


def _value(status):
    return None if status is None else getattr(status, "value", str(status))


# -- the operations ------------------------------------------------------------------------------------------
def op_enabled_clouds(request: dict):
    # sky.client.sdk.enabled_clouds (0.14; not re-exported as sky.enabled_clouds): answered from the API
    # server's cache of `sky check`, each cloud by its canonical_name() ("aws", "gcp")
    import sky
    from sky.client import sdk

    return [str(name).lower() for name in sky.get(sdk.enabled_clouds())]


def describe_task(task) -> dict:
    """What SkyPilot made of a task: its YAML (``yaml``; as its dashboard shows it, secrets redacted: ``shown``),
    and each candidate's resources as it parsed them."""
    resources = [{"cloud": str(r.cloud).lower() if r.cloud else None, "region": r.region,
                  "instance_type": r.instance_type, "use_spot": bool(r.use_spot),
                  "accelerators": dict(r.accelerators or {}), "labels": dict(r.labels or {}),
                  "ports": list(r.ports or []), "max_hourly_cost": getattr(r, "max_hourly_cost", None),
                  "disk_size": r.disk_size,
                  "job_recovery": r.job_recovery} for r in task.resources]
    return {"yaml": task.to_yaml_config(), "shown": task.to_yaml_config(use_user_specified_yaml=True),
            "resources": resources, "resources_kind": type(task.resources).__name__, "workdir": task.workdir,
            "file_mounts": task.file_mounts, "storage_mounts": sorted(task.storage_mounts or {})}


def op_task(request: dict):
    return describe_task(make_task(request))


def op_no_upload_config(request: dict):
    return no_upload_config(request.get("aws_node_profile"))


def op_launch(request: dict):
    """Send the launch (the workdir is uploaded within it) with the NO_UPLOAD override; its request id, for
    ``wait`` and ``cancel``."""
    import sky

    task = make_task(request["task"])
    with launch_config(request.get("aws_node_profile")):
        request_id = sky.launch(task, cluster_name=request["cluster_name"], down=True,
                                idle_minutes_to_autostop=request["idle_minutes"], retry_until_up=False,
                                dryrun=bool(request.get("dryrun")))
    return {"request_id": str(request_id)}


def op_wait(request: dict):
    """A launch request's result: the job and what it bought (a dry run's: its log, streamed to stderr)."""
    import sky

    if request.get("stream"):  # a dry run: what SkyPilot printed of it (the optimizer's table, "Dryrun finished")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            result = sky.stream_and_get(request["request_id"])
        return {"printed": printed.getvalue(), "result": repr(result)}
    job_id, handle = sky.get(request["request_id"])
    r = handle.launched_resources
    return {"job_id": job_id, "cloud": str(r.cloud).lower(), "region": r.region or "?",
            "instance_type": r.instance_type or "?", "spot": bool(r.use_spot),
            "name_on_cloud": getattr(handle, "cluster_name_on_cloud", None)}


def op_cancel(request: dict):
    import sky

    sky.api_cancel(request["request_id"], silent=True)  # the POST is the cancel; what it cancelled is not waited for


def op_status(request: dict):
    import sky

    names = request.get("names")
    records = sky.get(sky.status(names, refresh=sky.StatusRefreshMode.FORCE, all_users=names is None))
    return [{"name": r.name, "status": _value(r.status), "labels": dict(r.labels or {}),
             "name_on_cloud": r.cluster_name_on_cloud} for r in records]


def op_job_status(request: dict):
    """The job's status, None where SkyPilot has none (the cluster is not up or gone)."""
    import sky

    job_id = request.get("job_id")
    try:
        statuses = sky.get(sky.job_status(request["cluster_name"], [job_id] if job_id is not None else None))
    except (sky.exceptions.ClusterNotUpError, sky.exceptions.ClusterDoesNotExist):
        return None
    statuses = {str(k): v for k, v in (statuses or {}).items()}
    status = statuses.get(str(job_id)) if job_id is not None else next(iter(statuses.values()), None)
    return _value(status)


def op_down(request: dict):
    """Tear the cluster down; one that no longer exists is not an error."""
    import sky

    try:
        sky.get(sky.down(request["cluster_name"]))
    except sky.exceptions.ClusterDoesNotExist:
        pass


def op_jobs_launch(request: dict):
    import sky
    from sky import jobs

    job_ids, _handle = sky.get(jobs.launch(make_task(request["task"]), name=request["name"]))
    return job_ids[0] if job_ids else None


def _number(value):
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def op_accelerators(request: dict):
    """``sky.catalog.list_accelerators`` of every GPU in every region, each row as a plain mapping."""
    import sky
    import sky.catalog

    listing = sky.catalog.list_accelerators(gpus_only=True, clouds=request.get("clouds"), case_sensitive=False,
                                            all_regions=True, require_price=True)
    rows = {gpu: [{"cloud": str(i.cloud),
                   "instance_type": i.instance_type if isinstance(i.instance_type, str) else None,  # NaN: none
                   "accelerator_name": str(i.accelerator_name or gpu),
                   "accelerator_count": _number(i.accelerator_count),
                   "device_memory": _number(i.device_memory), "region": i.region, "price": _number(i.price),
                   "spot_price": _number(i.spot_price)} for i in infos] for gpu, infos in listing.items()}
    return {"version": getattr(sky, "__version__", None), "listing": rows}


def op_credentials(request: dict):
    """Credential files SkyPilot would copy to every VM whatever ``remote_identity`` says (clouds without the key,
    storage-only clouds), and whether its API server runs here (only then are those files the launch's)."""
    from sky import check as sky_check
    from sky.server import common
    from sky.utils import registry

    covered = [registry.CLOUD_REGISTRY.from_str(name) for name in clouds_with_remote_identity()]
    files = sorted(set(sky_check.get_cloud_credential_file_mounts(covered).values()))
    return {"local": bool(common.is_api_server_local()), "files": files}


OPS = {name[3:]: fn for name, fn in globals().items() if name.startswith("op_")}


def main(argv: list[str]) -> int:
    answer_to = os.fdopen(os.dup(1), "w")  # the answer alone on stdout; SkyPilot's own output goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if len(argv) != 1 or argv[0] not in OPS:
        answer = {"error": {"type": "UsageError", "mro": [], "message": f"usage: sky_bridge.py {{{','.join(OPS)}}}"}}
    else:
        try:
            answer = {"result": OPS[argv[0]](json.loads(sys.stdin.read() or "{}"))}
        except Exception as exc:  # answered, for the caller to raise as SkyPilot's error of that name
            answer = {"error": {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__[1:]],
                                "message": str(exc)}}
    answer_to.write(json.dumps(answer, default=str) + "\n")
    answer_to.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
