"""Who a replica belongs to (control/replica/plan.py `owner_verdict`, `same_run`; control/replica/admit.py
`record_of`, `earlier_starts`): a run that began again from step 0 before its first checkpoint is the run its
replica's owner record names, another run is refused, and an owner record written before run ids is read as
before. Plain ledger entries and owner records, no store, no processes."""

from __future__ import annotations

from andrea.control.replica.admit import earlier_starts, record_of
from andrea.control.replica.plan import owner_verdict, same_run
from andrea.rundir.ledger import marker

ID = {"model.arch": "gpt2", "train.seed": 1}


def start(t: float, run: str | None, identity=ID) -> dict:
    m = {**marker("start", 0, identity=identity), "time": t}
    return {**m, "run": run} if run is not None else m


def steps(*ss: int) -> list[dict]:
    return [{"step": s, "loss": 1.0, "time": 1.0} for s in ss]


def owner_of(entries: list[dict]) -> dict:
    """replica.json as the replicator of a process whose ledger held `entries` wrote it (its `format` aside)."""
    return {"format": 1, **record_of(entries)}


def test_a_start_again_from_step_0_before_any_checkpoint_claims_the_replica_its_earlier_start_recorded():
    first = [start(100.0, "a" * 32), *steps(1, 2, 3)]  # killed before its first checkpoint
    again = [*first, start(200.0, "b" * 32), *steps(1, 2)]  # the next start: a new marker, a new run id
    remote, local = owner_of(first), record_of(again)
    assert local["run"] == "b" * 32 and local["started"] == 200.0  # the newest start marker's
    assert earlier_starts(again) == [{"run": "a" * 32, "started": 100.0}]
    assert not same_run(remote, local)  # what the check compared: the restart looked like another run
    assert owner_verdict(remote, local, earlier_starts(again), published=[]) == "again"
    # once this start has claimed it, its record is the replica's: ours at every later start
    assert owner_verdict(owner_of(again), record_of(again), earlier_starts(again), published=[10]) == "ours"


def test_an_earlier_start_that_published_checkpoints_or_had_another_identity_is_another_run():
    first = [start(100.0, "a" * 32), *steps(1, 2)]
    again = [*first, start(200.0, "b" * 32)]
    remote, local, earlier = owner_of(first), record_of(again), earlier_starts(again)
    assert owner_verdict(remote, local, earlier, published=[10]) == "other"  # its checkpoints are in the replica
    other_id = [*first, start(200.0, "b" * 32, identity={**ID, "train.seed": 2})]
    assert owner_verdict(remote, record_of(other_id), earlier_starts(other_id), published=[]) == "other"


def test_a_replica_of_another_run_directory_is_refused_even_with_the_same_identity_and_nothing_published():
    theirs = [start(100.0, "a" * 32)]
    mine = [start(150.0, "c" * 32), *steps(1), start(200.0, "b" * 32)]  # started twice, never as "a"
    assert owner_verdict(owner_of(theirs), record_of(mine), earlier_starts(mine), published=[]) == "other"
    assert owner_verdict(owner_of(theirs), None, [], published=[]) == "other"  # a run not started yet
    assert owner_verdict({"format": 1, "claimed_by": {"host": "h", "pid": 1, "run_dir": "/r"}}, record_of(mine),
                         earlier_starts(mine), published=[]) == "starting"
    assert owner_verdict(None, record_of(mine), [], published=[]) == "none"


def test_an_owner_record_written_before_run_ids_is_read_by_its_start_markers_time():
    first = [start(100.0, None), *steps(1)]  # a record and a marker of before run ids
    old = {k: v for k, v in owner_of(first).items() if k != "run"}
    assert "run" not in old
    assert same_run(old, record_of([start(100.0, "d" * 32)]))  # no `run` in the record: not compared
    again = [*first, start(200.0, "b" * 32)]
    assert owner_verdict(old, record_of(again), earlier_starts(again), published=[]) == "again"
    assert owner_verdict(old, record_of([start(300.0, "e" * 32)]), [], published=[]) == "other"


def test_a_branch_is_another_run_than_its_parent_whose_start_marker_it_carries():
    parent = [start(100.0, "a" * 32), *steps(1, 2)]
    branch = [*parent, {**marker("branch", 2, parent="/p"), "time": 150.0}]
    assert record_of(branch)["run"] == "a" * 32 and record_of(branch)["branched"] == 150.0
    assert owner_verdict(owner_of(parent), record_of(branch), earlier_starts(branch), published=[]) == "other"
    assert owner_verdict(owner_of(branch), record_of(branch), earlier_starts(branch), published=[2]) == "ours"


def test_a_bit_flipped_in_the_start_markers_identity_or_time_leaves_the_run_its_own_replicas_owner():
    """Campaign seed 201: a flipped bit turned the start marker's `model.n_layer` into `model.N_layer`, and the start
    said its own replica "already holds another run" (with advice to pick another prefix) before the ledger check
    could say what was wrong and how to go on. The run id names the marker: a changed identity or time beside it is
    a damaged ledger (refused by the start in its own line), not another run; a changed branch time is another
    branch, and another id another run."""
    mine = [start(100.0, "a" * 32), *steps(1, 2)]
    remote = owner_of(mine)
    flipped = {**ID, "model.N_layer": 2}
    for damaged in ([start(100.0, "a" * 32, identity=flipped), *steps(1, 2)], [start(108.0, "a" * 32), *steps(1, 2)]):
        assert same_run(remote, record_of(damaged))
        assert owner_verdict(remote, record_of(damaged), earlier_starts(damaged), published=[5]) == "ours"
    assert not same_run(remote, record_of([start(100.0, "b" * 32), *steps(1, 2)]))
    assert not same_run(remote, {**record_of(mine), "branched": 150.0})


def test_a_start_marker_a_flipped_bit_made_unreadable_leaves_the_run_the_owner_its_checkpoints_vouch_for(tmp_path):
    """Campaign seed 201 again: the flip broke the start marker's line (`"model.n_layer":2` -> `"model.n_layer"::`),
    so the ledger held no readable start marker and the start refused its own replica as another run's, before the
    ledger check could name the damage and --accept-ledger-gap. The run id the newest checkpoint's checksum names
    stands in for the marker: the replica is still this run's (its intact record kept), and another id's is not."""
    import json

    from andrea.control.replica.admit import vouched_run
    from andrea.rundir import checksum
    digests = {region: "0" * 16 for region in checksum.REGIONS}
    for step, run in ((5, "b" * 32), (10, "a" * 32)):
        body = checksum.record(step, 4, digests, ledger="0" * 16, run=run)
        (tmp_path / f"step_{step:06d}.sum.json").write_text(json.dumps(body))
    (tmp_path / "step_000020.sum.json").write_text("{not json")  # the newest, damaged: passed over
    assert vouched_run(tmp_path) == "a" * 32
    remote = owner_of([start(100.0, "a" * 32), *steps(1, 2)])
    unreadable = steps(1, 2)  # what readable_entries returns once the marker's line no longer parses
    assert record_of(unreadable) is None
    local = record_of(unreadable, vouched_run(tmp_path))
    assert owner_verdict(remote, local, earlier_starts(unreadable), published=[10]) == "ours"
    theirs = owner_of([start(100.0, "c" * 32)])
    assert owner_verdict(theirs, local, earlier_starts(unreadable), published=[10]) == "other"
    assert vouched_run(tmp_path / "nowhere") is None
