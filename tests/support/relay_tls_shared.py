"""Shared by the tests: moved out of test_relay_tls.py (which imports them back) so other test modules import
them from here, not from a test module."""

from __future__ import annotations

import time

from echo2.broadcast.relay_tls import RelayTLS
from echo2.data import layout
from echo2.data.relay_certs import (
    ActorCertificate,
    RelayCA,
    ca_of_run,
)
from echo2.data.relay_tokens import mint

RUN = "r1"


def _ca_pem(store) -> str:
    return ca_of_run(store.get_json(layout.RUN_JSON))


def _bundle(key, actor: str, hours: float = 1.0) -> str:
    """What the learner's fleet gives an actor beside its token: its certificate and key."""
    return RelayCA(key, RUN).issue(actor, time.time() + hours * 3600)


def _token(key, actor: str) -> str:
    return mint(key, RUN, actor, time.time() + 3600)


def _tls(store, key, actor: str) -> RelayTLS:
    return RelayTLS(ActorCertificate(_bundle(key, actor)), _ca_pem(store))
