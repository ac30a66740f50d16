"""Progress of long single-process work (seed checkpoint, checkpoint conversion): a line on
stderr every few seconds with what is done, the rate and the time left.

Only on a terminal: a batch job's log would get a line every few seconds for hours, and the
work's own start and end lines already say what ran.
"""

import sys
import time


class Progress:
    """`add(n)` as units of work finish; `total` of them are expected. Prints
    'label: 3.2 of 16.0 GB (20%), 1.10 GB/s, 0:00:12 left' at most every `every_s` seconds and
    a last line at `close()` if it printed any and there is news."""

    def __init__(self, label: str, total: float, unit: str = "GB", scale: float = 1e9,
                 every_s: float = 5.0, stream=None, clock=time.monotonic):  # fmt: skip
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty()
        self.label, self.total, self.unit, self.scale = label, total, unit, scale
        self.every_s, self.clock = every_s, clock
        self.done, self.printed, self.shown = 0.0, False, 0.0
        self.start = self.last = clock()

    def add(self, n: float) -> None:
        self.done += n
        now = self.clock()
        if self.enabled and now - self.last >= self.every_s:
            self._print(now)

    def close(self) -> None:
        if self.printed and self.done != self.shown:
            self._print(self.clock())

    def _print(self, now: float) -> None:
        self.last, self.printed, self.shown = now, True, self.done
        rate = self.done / max(now - self.start, 1e-9)
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        pct = 100 * self.done / self.total if self.total else 100.0
        s = self.scale
        print(
            f"{self.label}: {self.done / s:.1f} of {self.total / s:.1f} {self.unit} ({pct:.0f}%), "
            f"{rate / s:.2f} {self.unit}/s, {time.strftime('%H:%M:%S', time.gmtime(left))} left",
            file=self.stream, flush=True,
        )  # fmt: skip
