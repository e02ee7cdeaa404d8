"""A sealed companion (rundir/sidecars.py's `seal`, `unseal`): every single bit flipped in its bytes is either
no JSON, a broken seal, or the same content; never a changed value taken as written. Plain data, no files."""

from __future__ import annotations

import json

import pytest

from andrea.rundir import sidecars
from tests.flips import json_flips


def test_every_bit_flipped_in_a_sealed_companion_is_caught_or_changes_nothing():
    body = {"version": 2, "step": 30, "remedy": {"attempts": 1, "since": 12, "data_offset": 25, "lr_scale": 0.5},
            "good": {"step": 20, "path": "step_000020.bin"}, "losses": [6.25, 1e-05, 5.125]}
    data = sidecars.json_bytes(sidecars.seal(body))
    assert sidecars.unseal(json.loads(data), "x") == body
    silent = 0
    for i, bit, flipped, read in json_flips(data):  # (not UTF-8, or not JSON: a reader says so)
        try:
            got = sidecars.unseal(read, "x")
        except sidecars.SidecarError:
            continue
        assert got == body, (i, bit, flipped)  # only what parses to the same values may pass (1e-05/1E-05)
        silent += 1
    assert silent <= 2  # the exponent's e <-> E, the one flip that JSON reads as the same number


def test_an_unsealed_or_resealed_object_is_refused_in_one_line():
    with pytest.raises(sidecars.SidecarError, match="no 'checksum' field"):
        sidecars.unseal({"step": 3}, "step_000003.guard.json")
    sealed = sidecars.seal({"step": 3, "data_offset": 25})
    with pytest.raises(sidecars.SidecarError, match="does not match its checksum") as e:
        sidecars.unseal({**sealed, "data_offset": 35}, "step_000003.guard.json")
    assert str(e.value).startswith("step_000003.guard.json: ") and "\n" not in str(e.value)


def test_every_bit_flipped_in_a_sealed_state_is_caught_by_its_reader_or_changes_nothing():
    """The data proxy's state is read through `opened`, which passes a state from before seals (no version, no
    checksum) as it is: no single flipped bit of a sealed state may make it read as one of those."""
    body = {"version": 2, "step": 20, "arms": ["code", "prose"], "phase": 0, "applied_upto": 10,
            "pending": {"steps": [10, 11], "arm_ids": [[0, 1], [1, 1]], "losses": [[3.25, 2.5], [2.75, 3.0]]},
            "bandit": {"weights": [0.5, 0.25], "pulls": [7, 9]}}
    data = sidecars.json_bytes(sidecars.seal(body))
    assert sidecars.opened(json.loads(data), "x") == body
    for i, bit, flipped, read in json_flips(data):
        try:
            got = sidecars.opened(read, "x")
        except sidecars.SidecarError:
            continue
        assert got == body, (i, bit, flipped)
