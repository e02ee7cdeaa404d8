"""The ranks' boundary agreement (andrea/control/parallel/ranks.py) and the ZeRO-1 bounds (andrea/control/parallel/distributed.py), as plain
functions: no processes, no signals."""

import pytest

from andrea.config.check import ConfigError
from andrea.control.parallel import ranks
from andrea.control.run.signals import Requests, boundary_action
from andrea.control.parallel.distributed import World, check_batch, row_bounds, shard_bounds, shard_size


def req(stop=None, checkpoint_at=None, pivot=False, failed=None) -> Requests:
    return Requests(stop=stop, checkpoint_at=checkpoint_at, pivot=pivot, failed=failed)


def agree_all(local: list[Requests]) -> list[Requests]:
    """What every rank holds after one exchange (the all-reduce MAX is `decide` over every rank's vector)."""
    agreed = ranks.decide([ranks.encode(r) for r in local])
    for r in local:
        ranks.merge(r, agreed)
    return local


def test_nothing_requested_is_nothing_agreed():
    assert ranks.decide([ranks.encode(req()), ranks.encode(req())]) == ranks.Agreed()


def test_a_stop_on_one_rank_stops_every_rank_at_the_same_step():
    for who in range(3):
        local = [req("SIGTERM" if i == who else None) for i in range(3)]
        actions = {boundary_action(17, 1000, 100, r) for r in agree_all(local)}
        assert actions == {boundary_action(17, 1000, 100, req("SIGTERM"))}
        (action,) = actions
        assert action.stop and action.checkpoint


def test_stop_reasons_other_than_signals_still_stop():
    assert ranks.decide([ranks.encode(req("divergence")), ranks.encode(req())]).stop is not None


def test_the_earliest_requested_checkpoint_wins_and_is_taken_once():
    local = agree_all([req(checkpoint_at=12), req(checkpoint_at=10), req()])
    assert [r.checkpoint_at for r in local] == [10, 10, 10]
    assert {boundary_action(9, 1000, 100, r).checkpoint for r in local} == {False}
    assert {boundary_action(10, 1000, 100, r).checkpoint for r in local} == {True}


def test_a_pivot_reaches_the_ranks_that_did_not_see_sighup():
    local = [req(checkpoint_at=30, pivot=True), req(), req()]
    agreed = ranks.decide([ranks.encode(r) for r in local])
    learned = [ranks.merge(r, agreed) for r in local]
    assert learned == [False, True, True]  # only the others must read policy.next.toml
    assert {boundary_action(30, 1000, 100, r) for r in local} == {boundary_action(30, 1000, 100, local[0])}
    assert boundary_action(30, 1000, 100, local[1]).pivot


def test_a_failed_write_on_one_rank_fails_every_rank_at_the_same_boundary():
    """The commit's verdict reaches each rank's event loop at its own moment: one rank may hold the failure at a
    boundary where another does not yet; the exchange gives it to all (none would be left in the next step)."""
    why = "step_000020.bin: checkpoint write failed on rank 1: No space left on device"
    local = agree_all([req(), req(failed=why), req()])
    assert [r.failed for r in local] == [ranks.FAILED_ELSEWHERE, why, ranks.FAILED_ELSEWHERE]
    assert {r.failed for r in agree_all([req(failed=why), req(failed=why)])} == {why}  # its own reason kept
    assert [r.failed for r in agree_all([req(), req()])] == [None, None]


def test_encoding_round_trips():
    for r in (req(), req("SIGINT"), req("SIGTERM", 5, True), req(None, 0), req(None, 10**9), req(failed="x")):
        got = ranks.decode(ranks.encode(r))
        assert (got.stop, got.checkpoint_at, got.pivot, got.failed) == (r.stop, r.checkpoint_at, r.pivot,
                                                                        r.failed is not None)


def test_one_process_shares_nothing():
    r = req("SIGTERM", 4)
    assert ranks.share(World(), r) is False and (r.stop, r.checkpoint_at) == ("SIGTERM", 4)


@pytest.mark.parametrize("n,size", [(10, 1), (10, 2), (10, 3), (10, 4), (169_728, 2), (169_729, 8), (3, 5)])
def test_shards_cover_the_flat_buffer_once_in_rank_order(n, size):
    bounds = [shard_bounds(n, size, r) for r in range(size)]
    covered = [i for lo, hi in bounds for i in range(lo, hi)]
    assert covered == list(range(n))
    assert all(hi - lo <= shard_size(n, size) for lo, hi in bounds)
    assert shard_size(n, size) * size - n < size  # padding never reaches a whole shard


def test_rows_split_the_global_batch_evenly():
    assert [row_bounds(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    check_batch(8, 4)
    with pytest.raises(ConfigError, match=r"train.batch_size=9 .*world size 2"):
        check_batch(9, 2)


def test_world_from_torchrun_environment():
    assert World.from_env({}) == World()
    w = World.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (w.rank, w.size, w.local_rank, w.leader, w.distributed) == (3, 4, 1, False, True)
    with pytest.raises(ConfigError, match="RANK=4"):
        World.from_env({"RANK": "4", "WORLD_SIZE": "4"})
