"""Dissemination plane: how policy versions reach the actors (docs/broadcast.md).

The learner publishes each version to the object store as chunked files under a manifest signed with the
run's key; every actor follows ``policy/LATEST`` and fetches each new version through the relay, from its
parent peer or from the store, checking every chunk against the manifest before it uses or serves it.

    relay.py          the HTTP relay in every actor (serves the chunks it holds) and the pipelined fetcher
                      (parent peer first, then its ancestors, then the store)
    relay_tls.py      mutual TLS 1.3 between relay peers, with certificates of the run's CA
    topology.py       the relay forest of a version, derived by every actor alike from the signed peer list
    receiver.py       the actor's side: follow LATEST, receive versions in the background, hand over
                      verified files
    reconstruct.py    sparse delta versions: rebuild full weights bit for bit from a keyframe and deltas
    weight_source.py  the actor's one call: the newest version ready to load (full tensors, or a base
                      version plus an adapter), whatever travelled: full, LoRA or delta

Actors use all of it; the learner's publisher (``echo2/learner/publisher.py``) only ``topology.py``, to sign the
relay plan into each manifest.
"""
