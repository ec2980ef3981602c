"""Dissemination plane: how policy versions reach the actors (docs/broadcast.md).

The learner publishes each version to the object store as chunked files under a manifest signed with the
run's key; every actor follows ``policy/LATEST`` and fetches each new version through the relay, from its
parent peer or from the store, checking every chunk against the manifest before it uses or serves it.

    protocol.py       what server and client share: a streamed run's tags, a source's errors, a parent of
                      the plan, the buffer a version is received into (every chunk checked as it is put)
    relay.py          the HTTP relay in every actor (serves the chunks it holds, a run of them per request)
    relay_node.py     ``RelayNode``: the relay's server and fetcher on one event loop in a background thread
    fetcher.py        the client: one streamed run of chunks per parent, then its ancestors, then the store
    rates.py          the up- and download rates a node measures on real transfers, and the rate a parent is
                      held to (its measured share and the child's need, over a floor)
    relay_tls.py      mutual TLS 1.3 between relay peers, with certificates of the run's CA
    topology.py       the relay plan of a version (one forest per provider and region), derived by every actor
                      alike from the signed peer list; peer records
    forest.py         the forest's shape from the rates peers report: fast peers near the roots with more
                      children, slow and demoted ones at the leaves
    receiver.py       the actor's side: follow LATEST, receive versions in the background, hand over
                      verified files
    reconstruct.py    sparse delta versions: rebuild full weights bit for bit from a keyframe and deltas
    weight_source.py  the actor's one call: the newest version ready to load (full tensors, or a base
                      version plus an adapter), whatever travelled: full, LoRA or delta

Actors use all of it; the learner's publisher (``echo2/learner/publisher.py``) only ``topology.py`` (and through it
``forest.py``), to sign the relay plan into each manifest.
"""
