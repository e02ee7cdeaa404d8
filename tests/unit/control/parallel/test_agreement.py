"""Ranks that disagree (control/parallel/agreement.py): the digest sees one flipped bit, the majority decides who is odd."""

import pytest
import torch

from andrea import testhooks
from andrea.config.check import ConfigError
from andrea.control.parallel.agreement import disagreement, flip_one_bit, weights_digest


def test_one_flipped_mantissa_bit_changes_the_digest_and_no_value_check_sees_it():
    w = torch.linspace(-1, 1, 1001)
    before = weights_digest(w)
    flipped = w.clone()
    flip_one_bit(flipped, index=517)
    assert torch.isfinite(flipped).all() and abs(float(flipped[517] - w[517])) < 1e-5
    assert weights_digest(flipped) != before and weights_digest(w.clone()) == before


def test_the_ranks_outside_the_majority_are_named_and_a_tie_goes_to_rank_0s_group():
    assert disagreement(["a", "a", "a"]) == []
    assert disagreement(["a", "b", "a", "a"]) == [1]
    assert disagreement(["b", "a", "a"]) == [0]  # rank 0 itself can be the corrupted one
    assert disagreement(["a", "b"]) == [1]  # two ranks: no majority, rank 0's copy is taken


def test_the_hook_reads_step_and_rank_and_refuses_anything_else_in_one_line(monkeypatch):
    for text, expected in (("", None), ("40@1", (40, 1)), ("7", (7, 0))):
        monkeypatch.setenv("ANDREA_TEST_FLIP_WEIGHT", text)
        assert testhooks.flip_weight() == expected
    monkeypatch.setenv("ANDREA_TEST_FLIP_WEIGHT", "x@1")
    with pytest.raises(ConfigError, match=r"^ANDREA_TEST_FLIP_WEIGHT='x@1': expected <header step>@<rank>$"):
        testhooks.flip_weight()
