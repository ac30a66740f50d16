"""titanlite/progress.py: lines only on a terminal, at most every every_s seconds, with what is
done, the rate and the time left, and a last line at close()."""

import io

from titanlite.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run(stream, adds):
    clock = iter(range(100))  # one second per call: start, then each add and close
    progress = Progress("writing", 8e9, every_s=2.0, stream=stream, clock=lambda: next(clock))
    for n in adds:
        progress.add(n)
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
