"""Progress of long single-process work (seed checkpoint, checkpoint conversion, data
preparation, the planner's search and dry runs): a line on stderr every few seconds with what is
done, the rate and the time left.

Only on a terminal: a batch job's log would get a line every few seconds for hours, and the
work's own start and end lines already say what ran.
"""

import sys
import time


class Progress:
    """`add(n)` as units of work finish; `total` of them are expected (None: not known, so no
    share or time left). Prints 'label: 3.2 of 16.0 GB (20%), 1.10 GB/s, 00:00:12 left' at most
    every `every_s` seconds and a last line at `close()` if it printed any and there is news.
    A `scale` of 1 counts whole units: '12,288 of 65,536 documents (19%), 2,345 documents/s'.
    `quiet`: never print (for work that every rank of a job does)."""

    def __init__(self, label: str, total: float | None, unit: str = "GB", scale: float = 1e9,
                 every_s: float = 5.0, stream=None, clock=time.monotonic, quiet=False):  # fmt: skip
        self.stream = sys.stderr if stream is None else stream
        self.enabled = not quiet and self.stream.isatty()
        self.label, self.total, self.unit, self.scale = label, total, unit, scale
        self.every_s, self.clock = every_s, clock
        self.done, self.kept, self.printed, self.shown = 0.0, 0.0, False, 0.0
        self.start = self.last = clock()

    def add(self, n: float, kept: bool = False) -> None:
        """`kept`: work found already done (an interrupted run's), counted as done but not in
        the rate, so the time left is not underestimated."""
        self.done += n
        self.kept += n if kept else 0
        now = self.clock()
        if self.enabled and now - self.last >= self.every_s:
            self._print(now)

    def close(self) -> None:
        if self.printed and self.done != self.shown:
            self._print(self.clock())

    def _amount(self, x: float) -> str:
        return f"{x:,.0f}" if self.scale == 1 else f"{x / self.scale:.1f}"

    def _print(self, now: float) -> None:
        self.last, self.printed, self.shown = now, True, self.done
        rate = (self.done - self.kept) / max(now - self.start, 1e-9) / self.scale
        text = f"{self.label}: {self._amount(self.done)}"
        if self.total is not None:
            pct = 100 * self.done / self.total if self.total else 100.0
            text += f" of {self._amount(self.total)} {self.unit} ({pct:.0f}%)"
        else:
            text += f" {self.unit}"
        text += f", {rate:,.0f}" if rate >= 100 else f", {rate:.2f}"
        text += f" {self.unit}/s"
        if self.total is not None:
            left = max(self.total - self.done, 0) / self.scale / rate if rate > 0 else 0.0
            text += f", {time.strftime('%H:%M:%S', time.gmtime(left))} left"
        if self.kept:
            text += f" ({self._amount(self.kept)} {self.unit} already done)"
        print(text, file=self.stream, flush=True)
