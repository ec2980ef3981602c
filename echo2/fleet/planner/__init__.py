"""The offline planner behind ``echo2 plan``: a whole run's fleet, hours and dollars before it starts, bought
with ``sizing/choose.py``'s ``choose_fleet``, as the live fleet is. The live fleet reads one thing from here: with
``fleet.workload`` it starts from this planner's fleet for that workload (``sizing/autosize.py``).

    workload_file.py         the workload (``infra/workloads/*.yaml`` or ``echo2 plan``'s flags): one object
    run_plan.py              the plan at the likely inputs: the learner's offer, the fleet, hours, dollars
    run_range.py             P10/P50/P90 over the uncertain inputs (Monte Carlo around the fleet bought)
    step_time.py             T, the learner's step, from FLOPs and MFU
    learner_memory.py        what the learner's ranks hold, and which instance can
    dissemination.py         D, a policy version's bytes and its way to the actors through the relay
    traffic.py               the bytes and dollars a run's versions, rollouts and checkpoints move
    decode.py, actor_speed.py  an actor's decode speed at its batch size, the draining batch
    reclaim_simulation.py    the extra instances that hold the fleet's throughput through spot reclaims
    spot_learner.py          a spot learner against an on-demand one: reclaims, gaps, the break-even rate
    run_costs.py             checkpoints, start-up, correlated reclaim bursts
    plan_notes.py            the plan's words: the notes and each assumption's source
    plan_table.py, range_table.py  the plan and the range as tables
    run_check.py             a finished local run predicted from its config and a machine profile, beside it
"""
