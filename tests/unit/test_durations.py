"""tests/durations.py: the durations record that orders `make test`, read from pytest's --durations output."""

from __future__ import annotations

from tests import durations

REPORT = """
============================= slowest durations ==============================
73.85s call     tests/e2e/test_a.py::test_one[cut]
 3.00s setup    tests/e2e/test_a.py::test_one[cut]
12.50s call     tests/faults/test_b.py::test_two
 0.50s teardown tests/unit/control/run/test_c.py::test_three
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_a_report_sums_each_files_setup_call_and_teardown():
    assert durations.parse(REPORT) == {"tests/e2e/test_a.py": 76.85, "tests/faults/test_b.py": 12.5,
                                       "tests/unit/control/run/test_c.py": 0.5}


def test_an_update_replaces_what_was_measured_keeps_the_rest_and_drops_the_gone():
    record = {"tests/e2e/test_a.py": 10.0, "tests/e2e/test_old.py": 5.0, "tests/unit/test_x.py": 1.0}
    new = durations.updated(record, {"tests/e2e/test_a.py": 76.85}, exists=lambda f: "old" not in f)
    assert new == {"tests/e2e/test_a.py": 76.8, "tests/unit/test_x.py": 1.0}  # rounded to 0.1 s


def test_an_unknown_file_ranks_as_the_mean_of_its_directory_then_the_one_above():
    record = {"tests/e2e/test_a.py": 100.0, "tests/e2e/test_b.py": 50.0, "tests/unit/control/run/test_c.py": 2.0}
    assert durations.estimate("tests/e2e/test_a.py", record) == 100.0
    assert durations.estimate("tests/e2e/test_new.py", record) == 75.0
    assert durations.estimate("tests/unit/control/mixture/test_new.py", record) == 2.0  # tests/unit/'s mean
    assert durations.estimate("elsewhere/test_z.py", record) == 0.0


def test_the_committed_record_names_only_files_that_exist():
    record = durations.load()
    assert record and all((durations.ROOT / f).is_file() for f in record), sorted(record)
