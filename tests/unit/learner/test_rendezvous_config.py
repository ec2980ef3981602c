"""What rank 0 sends over the unauthenticated rendezvous (``learner/distributed.py`` ``start_process``,
``learner/torchrun.py`` ``for_followers``): the run's config without the store's options (endpoint, credentials),
which no rank but 0 reads. The group itself is replaced at its boundary: ``init_process_group`` and the broadcast
(``share_config``) are test doubles that record what rank 0 would send."""

from __future__ import annotations

import json

from echo2.config import load_config
from echo2.learner import distributed


def test_rank_0_shares_the_config_without_the_store_options(tmp_path, monkeypatch):
    config = load_config(None, ["store.url=s3://bucket/echo2"]).model_dump(mode="json")
    config["store"]["options"] = {"key": "AKIA-test", "secret": "hunter2", "client_kwargs": {"region_name": "x"}}
    start_file = tmp_path / "start.json"
    start_file.write_text(json.dumps(config))
    sent = []
    monkeypatch.setattr(distributed, "init_process_group", lambda train: (0, 2))  # rank 0 of 2
    monkeypatch.setattr(distributed, "share_config", lambda shared: sent.append(shared) or shared)
    started = distributed.start_process(start_file)
    assert started.store.options["secret"] == "hunter2"  # rank 0 itself keeps them: it opens the store
    [shared] = sent
    assert shared["store"]["options"] == {} and shared["store"]["url"] == "s3://bucket/echo2"
    assert "hunter2" not in json.dumps(shared) and "AKIA-test" not in json.dumps(shared)


def test_a_follower_takes_its_groups_down_when_rank_0_says_stop(tmp_path, monkeypatch, one_rank_group):
    """A follower that exited with its gloo groups up aborted once in their C++ teardown ("terminate called without
    an active exception"): its torchrun reported the node failed and node 0's waited out its exit barrier. The
    group here is a one-rank group standing in for rank 1's; the learner is replaced (its follow returns at once)."""
    import signal

    import torch
    import torch.distributed as dist

    from echo2.learner import process_group

    start_file = tmp_path / "start.json"
    start_file.write_text(json.dumps(load_config(None, []).model_dump(mode="json")))

    def joined_as_rank_1(_learner_config):
        process_group.one_rank_group(torch.device("cpu"))
        return 1, 2

    followed = []
    monkeypatch.setattr(distributed, "init_process_group", joined_as_rank_1)
    monkeypatch.setattr(distributed, "share_config", lambda shared: json.loads(start_file.read_text()))
    monkeypatch.setattr("echo2.models.resolve_model", lambda name, revision=None: tmp_path)
    monkeypatch.setattr(distributed, "DistributedLearner",
                        lambda *args, **kwargs: type("Follower", (), {"follow": lambda self: followed.append(1)})())
    handlers = {signum: signal.getsignal(signum) for signum in distributed.STOP_SIGNALS}
    try:
        assert distributed.start_process(start_file) is None
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert followed == [1]
    assert not dist.is_initialized() and process_group._control is None
