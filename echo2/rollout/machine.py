"""What an actor learns from the machine it runs on: where its relay listens and how peers reach it.

The run's ``broadcast`` config is the same for every actor (it comes from ``run.json``), but the
address a relay binds and advertises is a fact of each machine: a local actor listens on 127.0.0.1,
a cloud VM on 0.0.0.0 behind the port SkyPilot opened, reachable at its public address. The fleet
backend says so per machine through the environment:

    ECHO2_RELAY_HOST       address the relay binds (e.g. 0.0.0.0)
    ECHO2_RELAY_PORT       port the relay binds (the one the backend opened)
    ECHO2_SITE             the machine's ``provider/region`` (the local backend sets it; on a SkyPilot VM it
                           comes from SkyPilot's $SKYPILOT_CLUSTER_INFO): a version whose relay plan does not
                           name the actor yet is fetched from a leaf of that site (``topology.guest_sources``)
    ECHO2_ADVERTISE_HOST   what goes in peers/<actor>.json: a host or address; ``metadata`` = the public
                           IPv4 from the instance metadata of $ECHO2_PREEMPTION_SOURCE's cloud (AWS IMDSv2,
                           GCP); ``interface`` = the address of the interface that routes to the internet
                           (right on clouds that put the public address on the VM, e.g. Lambda); ``auto`` =
                           ``metadata`` on a machine SkyPilot launched on AWS or GCP, else ``interface``
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket

from echo2.config import BroadcastConfig
from echo2.data.site import site_name, site_part
from echo2.preemption import CLUSTER_INFO_ENV, DEFAULT_ENDPOINTS, MetadataProbe, machine_cloud, resolve

log = logging.getLogger("echo2.actor")

HOST_ENV, PORT_ENV, ADVERTISE_ENV = "ECHO2_RELAY_HOST", "ECHO2_RELAY_PORT", "ECHO2_ADVERTISE_HOST"
SITE_ENV = "ECHO2_SITE"


def machine_site() -> str | None:
    """This machine's site as relay plans spell it (``provider/region``, the provider in lower case), from
    $ECHO2_SITE, else SkyPilot's cluster info; None where neither says (or says something malformed).
    Only this actor's own choice of a parent rests on it, so a wrong one costs that actor speed, not others."""
    provider = region = None
    if value := os.environ.get(SITE_ENV, "").strip():
        provider, _, region = value.partition("/")
    else:
        try:
            info = json.loads(os.environ.get(CLUSTER_INFO_ENV) or "{}")
        except ValueError:
            info = None
        if isinstance(info, dict):
            provider, region = info.get("cloud"), info.get("region")
    if not (site_part(provider) and site_part(region)):  # as the ledger's placement is checked
        if provider or region:
            log.warning("this machine's site is unreadable (provider %r, region %r from $%s or $%s); versions "
                        "not planned for it come from the store", provider, region, SITE_ENV, CLUSTER_INFO_ENV)
        return None
    return site_name(provider, region)


def interface_address() -> str:
    """The local address of the route to the internet (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: never reached, only routed
        return s.getsockname()[0]


def advertised_host(value: str, preemption_source: str | None, preemption_endpoint: str | None) -> str:
    """``value`` of $ECHO2_ADVERTISE_HOST as the address peers should dial."""
    cloud = machine_cloud()
    if value == "auto":
        value = "metadata" if cloud in DEFAULT_ENDPOINTS else "interface"
    if value == "interface":
        return interface_address()
    if value == "metadata":  # the cloud: $ECHO2_PREEMPTION_SOURCE, else SkyPilot's word, else the config
        source, base = resolve(cloud if cloud in DEFAULT_ENDPOINTS else preemption_source, preemption_endpoint)
        if source == "off":
            raise ValueError(f"{ADVERTISE_ENV}=metadata needs to know the cloud: $ECHO2_PREEMPTION_SOURCE "
                             f"(aws or gcp) or SkyPilot's $SKYPILOT_CLUSTER_INFO")
        return MetadataProbe(source, base).public_address()
    return value


def machine_broadcast(config: BroadcastConfig, *, preemption_source: str | None = None,
                      preemption_endpoint: str | None = None) -> BroadcastConfig:
    """``config`` with this machine's relay address from the environment (unchanged where none is set)."""
    updates: dict = {}
    if os.environ.get(HOST_ENV):
        updates["host"] = os.environ[HOST_ENV]
    if os.environ.get(PORT_ENV):
        port = os.environ[PORT_ENV].strip()
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{PORT_ENV}={port!r} is not a port number")
        updates["port"] = int(port)
    if os.environ.get(ADVERTISE_ENV):
        host = advertised_host(os.environ[ADVERTISE_ENV].strip(), preemption_source, preemption_endpoint)
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not host or any(c in host for c in "/:@ "):  # a name is fine; a URL or junk is not
                raise ValueError(f"{ADVERTISE_ENV} gave {host!r}, which is no host name or address") from None
        updates["advertise_host"] = host
    if not updates:
        return config
    log.info("relay on this machine: %s", ", ".join(f"{k}={v}" for k, v in updates.items()))
    return config.model_copy(update=updates)
