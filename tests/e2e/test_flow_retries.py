"""One layer owns store retries (issue 18, item 11): the ``echo2-train`` flow's tasks do not retry what the
store layer (echo2/data/store/fsspec_store.py, for ``store.retry_s``) already retried.

The collect task ran under ``retries=3`` for store errors on top of the store's own retry window, so a dead
store surfaced after 4 x ``retry_s`` (8 minutes at the default 120 s). Here the task runs in a real Prefect
flow against moto's S3 behind the fault-injecting proxy in an outage, with a real ``RolloutCollector``;
``retry_s=0`` makes the store layer's window one attempt, so the count of collect attempts and of failed
S3 requests is the measure, never the clock."""

from __future__ import annotations

import pytest
from prefect import flow

from echo2.chaos.s3_proxy import FaultyS3Proxy
from echo2.data.rollouts import RolloutLimits
from echo2.data.store import is_transient, open_store
from echo2.flows.train import collect_rollouts
from echo2.learner.collector import RolloutCollector

pytestmark = pytest.mark.e2e

LIMITS = RolloutLimits(vocab_size=100, group_size=2, max_completion_tokens=8, max_prompt_tokens=16,
                       reward_range=(0.0, 1.0))


def test_no_task_of_the_flow_retries_what_the_store_layer_retried():
    import echo2.flows.train as train

    tasks = [v for v in vars(train).values() if hasattr(v, "retry_condition_fn") and hasattr(v, "fn")]
    assert collect_rollouts in tasks and len(tasks) >= 5
    assert {t.name: t.retries for t in tasks} == {t.name: 0 for t in tasks}


class _CollectingRun:
    """The part of ``LearnerRun`` the collect task calls (``collect``), over a real collector and store; it
    counts how often the task ran it."""

    def __init__(self, collector: RolloutCollector):
        self.collector = collector
        self.attempts = 0

    def collect(self, should_abort=lambda: None):
        self.attempts += 1
        return self.collector.collect(1, 0, timeout_s=30, poll_s=0.05, should_abort=should_abort)


class _Fleet:
    def reconcile(self):
        return None


def test_a_dead_store_during_collect_surfaces_after_one_store_retry_window(s3_server, moto_credentials):
    proxy = FaultyS3Proxy(s3_server, fail_rate=0.0)
    url = proxy.start()
    try:
        store = open_store("s3://echo2-dead-store/runs/r1", {"endpoint_url": url, "skip_instance_cache": True},
                           retry_s=0)  # the store layer's whole retry window is one attempt here
        run = _CollectingRun(RolloutCollector(store, run_id="r1", staleness=2, groups_per_step=2, limits=LIMITS))
        proxy.outage(3600)

        @flow(name="collect-from-a-dead-store")
        def collect_once():
            return collect_rollouts(run, _Fleet(), step=1)

        with pytest.raises(Exception) as err:
            collect_once()
        assert is_transient(err.value), repr(err.value)  # the store's own error, as the store layer gave up
        # one run of the task: before, Prefect ran it 3 more times, each a whole store retry window again
        assert run.attempts == 1
        assert 1 <= proxy.failed <= 2  # the single request of the one attempt (2: aiohttp resent on a reset)
    finally:
        proxy.stop()
