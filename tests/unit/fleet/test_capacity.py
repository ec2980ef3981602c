"""The capacity model on hand-computed cases (fleet/sizing/capacity.py) and its fit from a run (fleet/sizing/fit.py)."""

import math

import pytest

from echo2.fleet.sizing.capacity import (
    Workload,
    closed_form_step_seconds,
    fill_seconds,
    min_staleness,
    predict,
    required_throughput,
    throughput,
    workers_needed,
)


def workload(**kw) -> Workload:
    base = dict(train_seconds=10.0, groups_per_step=8, groups_per_batch=8, staleness=2, dissemination_seconds=1.0,
                upload_seconds=0.5, max_pending_batches=1)
    return Workload(**{**base, **kw})


def test_required_throughput_is_groups_per_training_second():
    assert required_throughput(workload()) == pytest.approx(0.8)
    # a worker's throughput counts its upload: 8 groups per 5 s + 0.5 s
    assert throughput(workload(), [5.0, 5.0]) == pytest.approx(2 * 8 / 5.5)


def test_fill_time_counts_whole_batches_of_each_worker():
    w = workload(groups_per_batch=2, upload_seconds=0.0)
    assert fill_seconds(w, [3.0]) == 12.0            # 4 rounds of one worker
    assert fill_seconds(w, [3.0, 3.0, 3.0, 3.0]) == 3.0
    assert fill_seconds(w, [1.0, 10.0]) == 4.0       # the fast worker alone, before the slow one's first batch
    assert fill_seconds(w, []) == math.inf


def test_synchronous_step_is_train_plus_dissemination_plus_generation():
    w = workload(staleness=0)
    # T + D + G + U = 10 + 1 + 5 + 0.5
    assert closed_form_step_seconds(w, [5.0]) == pytest.approx(16.5)
    p = predict(w, [5.0])
    assert p.step_seconds == pytest.approx(16.5) and p.utilization == pytest.approx(10 / 16.5)
    assert p.bound == "staleness" and p.lag == {0: 1.0}


def test_one_step_of_staleness_hides_generation_shorter_than_a_step():
    w = workload(staleness=1)
    assert min_staleness(w, [5.0]) == 1              # ceil((1 + 5.5) / 10)
    p = predict(w, [5.0])
    assert p.utilization == pytest.approx(1.0) and p.bound == "learner" and p.lag == {1: 1.0}


def test_dissemination_longer_than_s_steps_of_training():
    # D = 25 s > S * T = 20 s: the learner waits. With transfers overlapping, T_step would be
    # (T + D + F) / (1 + S) = (10 + 25 + 5.5) / 3; one receiver transfers one version at a time,
    # so a version also waits for the transfer under way and the step is longer
    w = workload(staleness=2, dissemination_seconds=25.0)
    assert closed_form_step_seconds(w, [5.0]) == pytest.approx(40.5 / 3)
    assert predict(w, [5.0]).step_seconds > 40.5 / 3
    assert min_staleness(w, [5.0]) == 6              # ceil((25 + 5.5 + 25) / 10): D counted twice
    assert predict(workload(staleness=6, dissemination_seconds=25.0), [5.0]).utilization == pytest.approx(1.0)
    assert predict(workload(staleness=5, dissemination_seconds=25.0), [5.0]).utilization < 1.0


def test_a_short_dissemination_is_counted_once():
    # D = 9 s < T: the receiver is idle when a version appears; S_min = ceil((9 + 5.5) / 10) = 2
    w = workload(staleness=2, dissemination_seconds=9.0)
    assert min_staleness(w, [5.0]) == 2
    assert predict(w, [5.0]).utilization == pytest.approx(1.0)
    assert predict(workload(staleness=1, dissemination_seconds=9.0), [5.0]).utilization < 1.0


def test_too_slow_a_fleet_is_throughput_bound_at_any_staleness():
    w = workload(staleness=8)
    assert min_staleness(w, [11.5]) is None          # 8 groups / 12 s < 0.8 groups/s
    p = predict(w, [11.5])
    assert p.bound == "throughput" and p.step_seconds == pytest.approx(12.0)


def test_a_fleet_with_zero_throughput():
    w = workload()
    assert throughput(w, []) == 0 and min_staleness(w, []) is None
    p = predict(w, [])
    assert p.utilization == 0.0 and p.step_seconds == math.inf
    assert predict(w, [math.inf]).utilization == 0.0  # a worker that never finishes is no worker


def test_publish_period_adds_its_steps_to_the_staleness_needed():
    w = workload(staleness=1, publish_every=2)
    assert min_staleness(w, [5.0]) == 2              # k - 1 + ceil(6.5 / 10)
    assert predict(w, [5.0]).utilization < 1.0
    assert predict(workload(staleness=2, publish_every=2), [5.0]).utilization == pytest.approx(1.0)


def test_staleness_below_the_publish_period_never_gets_fresh_rollouts():
    p = predict(workload(staleness=0, publish_every=2), [5.0])
    assert p.utilization == 0.0


def test_flow_control_overshoot_is_reported_as_waste():
    # two actors start together when a version lands; one step needs one of the two batches, and at
    # S = 0 the other is stale by the time the learner could use it
    p = predict(workload(staleness=0), [5.0, 5.0])
    assert p.wasted_groups == pytest.approx(0.5, abs=0.01)


def test_workers_needed_is_the_smallest_fleet_that_reaches_the_target():
    w = workload(groups_per_batch=2, staleness=2, max_pending_batches=2)
    n = workers_needed(w, 10.0, 0.95, 8)
    assert predict(w, [10.0] * n).utilization >= 0.95 > predict(w, [10.0] * (n - 1)).utilization
    assert workers_needed(w, 1000.0, 0.95, 3) == 3   # capped


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError):
        workload(train_seconds=0)
    with pytest.raises(ValueError):
        workload(staleness=-1)


def test_a_waiting_learner_sees_files_at_its_poll_ticks():
    # one actor, 4 batches of 0.4 s per step of 1 s: throughput-bound at 1.6 s; the learner lists
    # the store every 0.25 s while it waits, so it starts a step up to one poll later
    w = workload(train_seconds=1.0, groups_per_batch=2, upload_seconds=0.0, dissemination_seconds=0.0, staleness=2)
    polled = Workload(**{**w.__dict__, "learner_poll_seconds": 0.25})
    base, late = predict(w, [0.4]).step_seconds, predict(polled, [0.4]).step_seconds
    assert base == pytest.approx(1.6, rel=0.01)
    assert base < late <= base + 0.25 + 1e-9


def test_a_swap_costs_the_actor_its_time_once_per_version():
    w = workload(train_seconds=1.0, groups_per_batch=2, upload_seconds=0.0, dissemination_seconds=0.0, staleness=2)
    swapping = Workload(**{**w.__dict__, "swap_seconds": 0.2})
    assert predict(swapping, [0.4]).step_seconds == pytest.approx(predict(w, [0.4]).step_seconds + 0.2, rel=0.02)


def test_only_the_commit_holds_an_actor_back():
    # U = 0.5 s until the learner sees a file, of which the actor waits 0.05 s for its put
    w = workload(groups_per_batch=2, upload_seconds=0.5)
    assert throughput(Workload(**{**w.__dict__, "put_seconds": 0.05}), [1.0]) == pytest.approx(2 / 1.05)
    assert throughput(w, [1.0]) == pytest.approx(2 / 1.5)  # by default the actor waits for all of U
