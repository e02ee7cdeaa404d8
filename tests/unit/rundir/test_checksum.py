"""The checksum's companions: which missing or foreign `.sum.json` makes a checkpoint unverified (pure)."""

from andrea.rundir.checksum import companion_problem

SUM = {"regions": {}, "ledger": "aa"}


def test_a_checksum_lost_beside_evidence_that_it_existed_is_unverified():
    assert "missing" in companion_problem(None, has_ledger_record=True, ledger_digest="aa", older_has_checksum=False)
    assert "older checkpoints" in companion_problem(None, False, None, older_has_checksum=True)
    assert companion_problem(None, False, None, False) is None  # from before checksums, like its neighbours


def test_a_checksum_bound_to_another_ledger_or_to_a_lost_one_is_refused():
    assert companion_problem(SUM, True, "aa", False) is None
    assert "another run" in companion_problem(SUM, True, "bb", False)
    assert "ledger record" in companion_problem(SUM, False, None, True)
    assert companion_problem({"regions": {}}, False, None, True) is None  # a checksum from before the binding
