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


def test_a_checksum_that_names_another_run_is_refused_whatever_its_ledger_record_says():
    """Issue 55, hole 3: another run's complete set (`.bin`, checksum, ledger record) agrees with itself; the run
    its checksum names is what tells it from this run's. A run or a checksum from before ids is not compared."""
    ours, theirs = "1" * 32, "2" * 32
    bound = {**SUM, "run": theirs}
    problem = companion_problem(bound, True, "aa", False, run=ours)
    assert "another run's checkpoint" in problem and theirs in problem and ours in problem
    assert "--init-from" in problem and "--accept-ledger-gap" not in problem
    assert companion_problem(bound, True, "aa", False, run=theirs) is None
    assert companion_problem(bound, True, "aa", False, run=None) is None  # this run predates ids
    assert companion_problem(SUM, True, "aa", False, run=ours) is None  # the checkpoint predates them


def test_a_checkpoint_names_the_run_of_the_ledger_it_was_committed_on(tmp_path):
    """The run's id travels start marker -> ledger record (`seal`) -> checksum (`write`), and every reader
    compares it with the id of the directory it finds the checkpoint in (`check_companions`)."""
    import json

    import numpy as np

    from andrea.rundir import checksum, names
    from andrea.rundir.ledger import LossLedger
    from andrea.rundir.ledger_seal import run_id
    from andrea.rundir.checkpoint_write import commit_checkpoint

    def start(run_dir, run):
        led = LossLedger(run_dir / names.LEDGER_NAME)
        led.append([{"event": "start", "step": 0, "time": 0.0, "run": run}, {"step": 1, "loss": 1.0}])
        led.sync()
        (run_dir / "step_000001.ledger.json").write_bytes(led.record_bytes())
        led.close()
        commit_checkpoint(run_dir, 1, np.zeros(3, dtype=np.float32))

    for name, run in (("ours", "1" * 32), ("theirs", "2" * 32)):
        (tmp_path / name).mkdir()
        start(tmp_path / name, run)
        assert run_id(tmp_path / name / names.LEDGER_NAME) == run
        assert checksum.read(tmp_path / name / "step_000001.bin")["run"] == run
        assert checksum.check_companions(tmp_path / name / "step_000001.bin",
                                         checksum.read(tmp_path / name / "step_000001.bin")) is None
    for f in (tmp_path / "theirs").glob("step_000001.*"):  # the complete set copied over ours
        (tmp_path / "ours" / f.name).write_bytes(f.read_bytes())
    copied = tmp_path / "ours" / "step_000001.bin"
    assert "another run's checkpoint" in checksum.check_companions(copied, checksum.read(copied))


def test_a_bit_changed_in_a_checkpoints_ledger_record_makes_it_unverified(tmp_path):
    """Campaign seed 58: a flip turned the ledger record's "last_step" into "las4_step" and `verify` said ok, since
    the checksum binds the record's hash of the ledger, not its length or last step. The record is sealed: every
    single bit flipped in it is no JSON, a broken seal (the checkpoint unverified, by every reader), or the same
    content; a record from before seals (no version, no checksum) is read as before."""
    import json

    import numpy as np

    from andrea.rundir import checksum, names
    from andrea.rundir.checkpoint_write import commit_checkpoint
    from andrea.rundir.ledger import LossLedger
    from tests.flips import json_flips

    led = LossLedger(tmp_path / names.LEDGER_NAME)
    led.append([{"event": "start", "step": 0, "time": 0.0, "run": "1" * 32}, {"step": 1, "loss": 1.0}])
    led.sync()
    record = names.companion_path(tmp_path, 1, "ledger")
    intact = led.record_bytes()
    record.write_bytes(intact)
    led.close()
    commit_checkpoint(tmp_path, 1, np.zeros(3, dtype=np.float32))
    ckpt = tmp_path / "step_000001.bin"
    assert checksum.check_companions(ckpt, checksum.read(ckpt)) is None
    body = json.loads(intact)
    silent = 0
    for i, bit, flipped, read in json_flips(intact):
        record.write_bytes(flipped)
        problem = checksum.check_companions(ckpt, checksum.read(ckpt))
        if problem is None:
            assert read == body, (i, bit, flipped)
            silent += 1
        else:
            assert "\n" not in problem and "unverified" in problem
    assert silent == 0
    record.write_text(json.dumps({k: v for k, v in body.items() if k not in ("version", "checksum")}))
    assert checksum.check_companions(ckpt, checksum.read(ckpt)) is None  # written before seals
