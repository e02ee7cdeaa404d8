"""`make mutants` runs outside `make test`; its mutations are exact texts of the code they plant bugs in, so a change
to that code would leave a mutation that no longer applies, found only at the next `make mutants`. This checks, in
`make test`, that every mutation in tests/mutants.py applies exactly once to the working tree (no mutation runs)."""

from __future__ import annotations

from tests import mutants


def test_every_mutation_applies_exactly_once_to_the_code_as_it_is():
    assert mutants.check_applies(mutants.MUTANTS, mutants.ROOT) == []
