"""dppo._text.one_line: the one helper every layer uses to put a message into one line of an error."""

import pytest

from dppo._text import one_line


def test_whitespace_runs_and_newlines_become_one_space():
    assert one_line(ValueError("a\n  b\t\tc \n")) == "a b c"


@pytest.mark.parametrize(
    ("limit", "expected"), [(10, "0123456..."), (13, "0123456789abc"), (None, "0123456789abc"), (2, "...")]
)
def test_cut_to_limit_with_an_ellipsis(limit, expected):
    out = one_line("0123456789abc", limit)
    assert out == expected and (limit is None or len(out) <= max(limit, 3))


def test_the_default_limit_is_300():
    assert len(one_line("x" * 1000)) == 300 and one_line("x" * 300) == "x" * 300
