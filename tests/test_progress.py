"""titanlite/progress.py: lines only on a terminal, at most every every_s seconds, with what is
done, the rate and the time left, and a last line at close(); counts of whole units, an unknown
total, and work found already done."""

import io

from conftest import Terminal

from titanlite.progress import Progress


def run(stream, adds, label="writing", total=8e9, **kw):
    """The lines of a Progress fed `adds` (amounts, or (amount, kept) pairs)."""
    clock = iter(range(100))  # one second per call: start, then each add and close
    progress = Progress(label, total, every_s=2.0, stream=stream, clock=lambda: next(clock), **kw)
    for n in adds:
        progress.add(*(n if isinstance(n, tuple) else (n,)))
    progress.close()
    return stream.getvalue().splitlines()


def test_on_a_terminal_a_line_every_few_seconds_and_one_at_the_end():
    lines = run(Terminal(), [1e9, 1e9, 2e9, 2e9, 2e9])
    # adds at t=1..5: lines at t=2 and t=4 (2 s apart, not t=5); close at t=6 says the end
    assert lines == [
        "writing: 2.0 of 8.0 GB (25%), 1.00 GB/s, 00:00:06 left",
        "writing: 6.0 of 8.0 GB (75%), 1.50 GB/s, 00:00:01 left",
        "writing: 8.0 of 8.0 GB (100%), 1.33 GB/s, 00:00:00 left",
    ]


def test_quiet_when_not_a_terminal():
    assert run(io.StringIO(), [1e9] * 8) == []


def test_whole_units_and_work_already_done():
    # 3,000 documents found done (an interrupted run's) count as done, not as speed.
    lines = run(Terminal(), [(3000, True), 500, 500, 1000], "c4", 10_000, unit="documents",
                scale=1)  # fmt: skip
    assert lines == [
        "c4: 3,500 of 10,000 documents (35%), 250 documents/s, 00:00:26 left "
        "(3,000 documents already done)",
        "c4: 5,000 of 10,000 documents (50%), 500 documents/s, 00:00:10 left "
        "(3,000 documents already done)",
    ]


def test_an_unknown_total_shows_no_share_or_time_left():
    lines = run(Terminal(), [1, 1, 1, 3], "plan: search", None, unit="layouts", scale=1)
    assert lines == ["plan: search: 2 layouts, 1.00 layouts/s",
                     "plan: search: 6 layouts, 1.50 layouts/s"]  # fmt: skip


def test_quiet_even_on_a_terminal_when_asked():
    assert run(Terminal(), [1e9] * 8, quiet=True) == []
