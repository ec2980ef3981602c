"""Preemption notices: learn that the provider is about to take this machine, and stop cleanly.

A spot VM is warned before it is reclaimed: AWS posts ``spot/instance-action`` in the instance
metadata (IMDSv2) about two minutes ahead, GCP flips ``instance/preempted`` to ``TRUE`` about 30 s
ahead (and sends ACPI shutdown, which becomes SIGTERM). An actor that hears the notice stops taking
work, lets a commit already under way finish (or drops the batch in generation), leaves ``peers/``
so no child keeps fetching from it, and exits 0, instead of being cut off mid-write with its peer
record left for others to time out on. SIGTERM needs no watcher: the actor's signal handler is the
notice path, and this watcher ends in the same handler (``_thread.interrupt_main(SIGTERM)``).

A spot learner (``learner.market: spot``) uses the same probes and watcher for its own machine
(``echo2/learner/notice.py``): it checkpoints within the notice and leaves its actors running. This
module lives outside ``echo2/rollout/`` so the learner need not import the rollout plane; the actor imports it
from here too.

Off by default, so no actor ever talks to a metadata address it was not told to. Enabled by
``rollout.preemption_source`` or, per machine, ``$ECHO2_PREEMPTION_SOURCE`` (``aws`` | ``gcp`` |
``off`` | ``auto``). The SkyPilot task sets ``auto``: the cloud SkyPilot says the machine is on
(``$SKYPILOT_CLUSTER_INFO``), if it is one with notices in its metadata (one launch's any_of may span
clouds, so neither the run-wide config nor the launch can know). ``$ECHO2_PREEMPTION_ENDPOINT`` (or
``rollout.preemption_endpoint``) replaces the metadata base URL; tests point it at 127.0.0.1.

Requests go straight to the endpoint, never through an HTTP proxy from the environment (the
metadata service is link-local; a proxy would answer for another machine, or not at all).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("echo2.preemption")

SOURCE_ENV = "ECHO2_PREEMPTION_SOURCE"
ENDPOINT_ENV = "ECHO2_PREEMPTION_ENDPOINT"
SOURCES = ("off", "aws", "gcp", "auto")
CLUSTER_INFO_ENV = "SKYPILOT_CLUSTER_INFO"
"""JSON SkyPilot puts in every job's environment: ``{"cluster_name", "cloud", "region", "zone"}``."""
DEFAULT_ENDPOINTS = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal"}
AWS_TOKEN_TTL_S = 21600
"""IMDSv2 session token lifetime asked for (the maximum, 6 h); refreshed well before it ends."""


@dataclass(frozen=True)
class Notice:
    source: str
    detail: str
    """What the endpoint said (AWS: the instance-action JSON; GCP: ``TRUE``)."""


def resolve(source: str | None, endpoint: str | None) -> tuple[str, str | None]:
    """The source and base URL in force: the environment (set per machine) over the config.

    ``("off", None)`` unless something asks for a watcher; an unknown source is refused loudly (a typo
    would otherwise silently leave a spot actor deaf to its notice)."""
    source = (os.environ.get(SOURCE_ENV) or source or "off").strip().lower()
    if source not in SOURCES:
        raise ValueError(f"unknown preemption source {source!r} (${SOURCE_ENV} or rollout.preemption_source): "
                         f"expected one of {', '.join(SOURCES)}")
    if source == "auto":  # the cloud SkyPilot launched this machine on, where its metadata has notices
        source = machine_cloud() if machine_cloud() in DEFAULT_ENDPOINTS else "off"
    if source == "off":
        return "off", None
    base = os.environ.get(ENDPOINT_ENV) or endpoint or DEFAULT_ENDPOINTS[source]
    return source, base.rstrip("/")


def machine_cloud() -> str | None:
    """The cloud this machine was launched on (``aws``, ``gcp`` ...), from SkyPilot's job environment."""
    try:
        cloud = json.loads(os.environ.get(CLUSTER_INFO_ENV) or "{}").get("cloud")
    except (ValueError, AttributeError):
        return None
    return str(cloud).strip().lower() or None if cloud else None


class MetadataProbe:
    """One check of the provider's metadata: a ``Notice`` if the machine is being taken, else None.

    Raises ``OSError`` (``urllib.error.URLError`` included) when the endpoint cannot be asked; the
    watcher logs that and keeps asking, it is not a notice."""

    def __init__(self, source: str, base_url: str, *, timeout_s: float = 2.0):
        if source not in ("aws", "gcp"):
            raise ValueError(f"no metadata probe for {source!r}")
        self.source = source
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
        self._token: str | None = None
        self._token_at = 0.0

    def _open(self, request: urllib.request.Request) -> tuple[int, bytes]:
        try:
            with self._opener.open(request, timeout=self.timeout_s) as reply:
                return reply.status, reply.read(64 * 1024)
        except urllib.error.HTTPError as exc:  # 404 and 401 are answers here, not failures
            body = exc.read(64 * 1024) if exc.fp is not None else b""
            exc.close()
            return exc.code, body

    def poll_notice(self) -> Notice | None:
        """Ask the metadata once: the ``Notice`` if the machine is being taken, else None."""
        return self._poll_aws() if self.source == "aws" else self._poll_gcp()

    def public_address(self) -> str:
        """This machine's public IPv4, as the metadata knows it (what peers on other hosts dial)."""
        if self.source == "aws":
            request = urllib.request.Request(f"{self.base_url}/latest/meta-data/public-ipv4",
                                             headers={"X-aws-ec2-metadata-token": self._aws_token(time.monotonic())})
        else:
            request = urllib.request.Request(
                f"{self.base_url}/computeMetadata/v1/instance/network-interfaces/0/access-configs/0/external-ip",
                headers={"Metadata-Flavor": "Google"})
        status, body = self._open(request)
        address = body.decode(errors="replace").strip()
        if status != 200 or not address:
            raise OSError(f"{self.source} metadata has no public address (answered {status})")
        return address

    def _aws_token(self, now: float) -> str:
        if self._token is None or now - self._token_at > AWS_TOKEN_TTL_S / 2:
            request = urllib.request.Request(f"{self.base_url}/latest/api/token", method="PUT", data=b"",
                                             headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)})
            status, body = self._open(request)
            if status != 200:
                raise OSError(f"IMDSv2 token request answered {status}")
            self._token, self._token_at = body.decode().strip(), now
        return self._token

    def _poll_aws(self) -> Notice | None:
        for attempt in range(2):  # a token the service forgot (401) is fetched again once
            token = self._aws_token(time.monotonic())
            request = urllib.request.Request(f"{self.base_url}/latest/meta-data/spot/instance-action",
                                             headers={"X-aws-ec2-metadata-token": token})
            status, body = self._open(request)
            if status == 401 and attempt == 0:
                self._token = None
                continue
            break
        if status == 404:
            return None  # no action scheduled
        if status != 200:
            raise OSError(f"spot/instance-action answered {status}")
        text = body.decode(errors="replace").strip()
        try:
            action = json.loads(text).get("action")
        except (ValueError, AttributeError):
            action = None
        if action not in ("terminate", "stop", "hibernate"):
            raise OSError(f"spot/instance-action answered an unexpected body: {text[:200]!r}")
        return Notice("aws", text)

    def _poll_gcp(self) -> Notice | None:
        request = urllib.request.Request(f"{self.base_url}/computeMetadata/v1/instance/preempted",
                                         headers={"Metadata-Flavor": "Google"})
        status, body = self._open(request)
        if status != 200:
            raise OSError(f"instance/preempted answered {status}")
        text = body.decode(errors="replace").strip().upper()
        if text == "TRUE":
            return Notice("gcp", "TRUE")
        if text == "FALSE":
            return None
        raise OSError(f"instance/preempted answered an unexpected body: {text[:200]!r}")


class PreemptionWatcher:
    """A daemon thread that asks the metadata every ``poll_s`` seconds and calls ``on_notice`` once.

    The first notice ends it: there is nothing more to learn, and the actor is on its way out."""

    def __init__(self, probe: MetadataProbe, on_notice: Callable[[Notice], None], *, poll_s: float = 5.0):
        self.probe = probe
        self.on_notice = on_notice
        self.poll_s = poll_s
        self.notice: Notice | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="echo2-preemption", daemon=True)
        self._failing = False

    def start(self) -> "PreemptionWatcher":
        log.info("watching %s metadata at %s for a preemption notice every %.1fs",
                 self.probe.source, self.probe.base_url, self.poll_s)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                notice = self.probe.poll_notice()
            except OSError as exc:  # logged once per outage: an unreachable endpoint is not a notice
                if not self._failing:
                    log.warning("cannot read the %s preemption notice (will keep trying): %s", self.probe.source, exc)
                self._failing = True
                notice = None
            else:
                if self._failing:
                    log.info("%s metadata answers again", self.probe.source)
                self._failing = False
            if notice is not None:
                self.notice = notice
                log.warning("preemption notice from %s metadata: %s", notice.source, notice.detail)
                self.on_notice(notice)
                return
            self._stop.wait(self.poll_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.probe.timeout_s * 2 + 1)


def start_watcher(source: str | None, endpoint: str | None, poll_s: float,
                  on_notice: Callable[[Notice], None]) -> PreemptionWatcher | None:
    """A running watcher if a source is configured (config or environment), else None."""
    source, base = resolve(source, endpoint)
    if source == "off":
        return None
    return PreemptionWatcher(MetadataProbe(source, base), on_notice, poll_s=poll_s).start()
