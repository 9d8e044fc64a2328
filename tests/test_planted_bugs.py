"""The planted-bug list stays applicable as the code moves on (running it is `python tests/planted_bugs.py`)."""

import pytest
from planted_bugs import BUGS, ROOT


@pytest.mark.parametrize("bug", BUGS, ids=[b.name for b in BUGS])
def test_planted_bug_still_applies(bug):
    """Each edit's text occurs exactly once in its file, and each catching test file exists."""
    for file, old, new in bug.edits:
        assert old != new
        assert (ROOT / file).read_text().count(old) == 1, f"{bug.name}: {file} no longer holds exactly one {old!r}"
    for test in bug.tests:
        assert (ROOT / test.split("::")[0]).is_file(), f"{bug.name}: no test file {test}"
