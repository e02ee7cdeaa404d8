"""`UserError`: the base of every error a person fixes from its message. Reads and writes nothing.

Such an error's message is ONE line naming the file, key or setting and the problem. `andrea`'s command line
(cli.py) catches the base, prints `andrea: error: <message>` and exits with the class's `exit_code` (2 for a
configuration or command line, 1 otherwise), so a new kind of error cannot miss that line: derive it from
`UserError` (beside the built-in base its callers catch, e.g. `class LedgerError(UserError, ValueError)`).
tests/unit/test_errors.py finds every exception class in the package and checks it does, or is listed there as
one that never reaches the command line.
"""

from __future__ import annotations


class UserError(Exception):
    """An error whose one-line message tells the user what to fix; `exit_code` is the process's exit status."""

    exit_code = 1
