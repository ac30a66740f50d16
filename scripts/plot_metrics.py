"""Plot training curves from the metrics.jsonl of one run or several side by side.

    python scripts/plot_metrics.py outputs/debug -o curves.png
    python scripts/plot_metrics.py outputs/run_a outputs/run_b -o compare.png --dpi 120
    python scripts/plot_metrics.py outputs/run_a outputs/run_b -o compare.png --x tokens

Each RUN_DIR is a job.dump_folder (or the metrics.jsonl in one): train.py writes one JSON
object per logged step to {dump_folder}/metrics.jsonl. The figure has one panel per quantity,
against the step: loss (train solid; validation dashed with dots, where validation ran),
learning rate, grad norm, tokens/s per device, MFU, peak memory (reserved; on CUDA also
active, dashed), data-loading time as a share of step time and, for a weighted mixture, the
loss of each source (loss/<name>; validation val_loss/<name> with dots) and the tokens each
source gave (tokens_seen/<name>), a line style per source. One colour per run, named by
its folder. A panel no run logged a value for (MFU without a known peak) is left out, and so
is a line (validation loss where validation never ran). The image format follows the -o suffix
(png, pdf, svg).

The x axis is the step, or with `--x tokens` the tokens seen (metrics.jsonl's tokens_seen: the
job's global batch x seq_len per step so far), which puts runs of different batch sizes on one
scale.

Bad input (a RUN_DIR without metrics.jsonl, an empty or corrupt line) stops with one line on
stderr and exit status 2. Needs matplotlib (pip install matplotlib).
"""

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path


class MetricsError(ValueError):
    """Bad input: main prints it as one line and exits 2."""


@dataclass(frozen=True)
class Series:
    """One line in a panel: a metrics key, how it is drawn and its name in the panel's legend."""

    key: str
    style: str = "-"
    marker: str = ""
    label: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]


# Keys are MetricsLogger's (titanlite/metrics.py); units are its: wps per device, mfu and
# data_time_pct in percent, memory in GiB. Validation is logged every validation.freq steps
# only, so it gets dots: a run with one validation point still shows it.
PANELS = (
    Panel("loss", (Series("loss", label="train"), Series("val_loss", "--", "o", "validation"))),
    Panel("learning rate", (Series("lr"),)),
    Panel("grad norm", (Series("grad_norm"),)),
    Panel("tokens/s per device", (Series("wps"),)),
    Panel("MFU (%)", (Series("mfu"),)),
    Panel(
        "peak memory (GiB)",
        (Series("memory_gib", label="reserved"), Series("memory_active_gib", "--", "", "active")),
    ),
    Panel("data loading (% of step time)", (Series("data_time_pct"),)),
)
PLOTTED_KEYS = {s.key for p in PANELS for s in p.series}
# A mixture's per-source keys (titanlite/source_loss.py, titanlite/data/mixture.py): per panel,
# (prefix, marker, legend suffix) of its lines.
SOURCE_PANELS = {
    "loss per source": (("loss/", "", ""), ("val_loss/", "o", " (validation)")),
    "tokens per source": (("tokens_seen/", "", ""),),
}


def source_panel(runs: dict[str, dict[int, dict]]) -> list[Panel]:
    """A mixture run's panels: each source's loss and tokens seen, one line style per source."""
    logged = {key for records in runs.values() for r in records.values() for key in r}
    prefixes = [prefix for lines in SOURCE_PANELS.values() for prefix, _, _ in lines]
    names = sorted({k.split("/", 1)[1] for k in logged if k.startswith(tuple(prefixes))})
    styles = ("-", "--", ":", "-.")
    panels = []
    for title, lines in SOURCE_PANELS.items():
        series = [
            Series(prefix + name, styles[i % 4], marker, name + suffix)
            for i, name in enumerate(names)
            for prefix, marker, suffix in lines
            if prefix + name in logged
        ]
        panels += [Panel(title, tuple(series))] if series else []
    return panels


def metrics_file(run: Path) -> Path:
    """The run's metrics.jsonl; a path to the file itself is taken as is."""
    path = run if run.is_file() else run / "metrics.jsonl"
    if not path.is_file():
        raise MetricsError(
            f"{path}: not found; pass a job.dump_folder (the folder train.py wrote "
            "metrics.jsonl into)"
        )
    return path


def parse_line(path: Path, lineno: int, line: str) -> dict:
    """One record, checked enough that plotting cannot fail on it later."""
    where = f"{path}:{lineno}"
    if not line.strip():
        raise MetricsError(f"{where}: empty line (expected one JSON object per line)")
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise MetricsError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise MetricsError(f"{where}: expected a JSON object with an integer 'step'")
    for key in PLOTTED_KEYS & record.keys():
        value = record[key]
        # null means "not measured this step" (MetricsLogger writes every standard key).
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise MetricsError(f"{where}: {key} is {value!r}, expected a number or null")
    return record


def load_run(run: Path) -> dict[int, dict]:
    """The run's records by step, in step order.

    metrics.jsonl is appended to, so a run resumed from a checkpoint logs again the steps after
    that checkpoint: the later record of a step wins. Only non-null values overwrite, so a
    validation-only record (train keys null) cannot erase a train record of the same step.
    """
    path = metrics_file(run)
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            record = parse_line(path, lineno, line)
            merged = by_step.setdefault(record["step"], {})
            merged.update({k: v for k, v in record.items() if v is not None})
    if not by_step:
        raise MetricsError(f"{path}: empty (no step logged yet)")
    return dict(sorted(by_step.items()))


X_KEYS = {"step": "step", "tokens": "tokens_seen"}


def series_points(records: dict[int, dict], key: str, x: str = "step") -> tuple[list, list]:
    """(x values, values) of the steps that logged `key`, x being the step or the tokens seen.
    Non-finite values (a NaN loss on a skipped step) are dropped: an infinity would squash the
    rest of the axis to a line."""
    xs, values = [], []
    for record in records.values():
        value, at = record.get(key), record.get(X_KEYS[x])
        if value is not None and at is not None and math.isfinite(value):
            xs.append(at)
            values.append(value)
    return xs, values


def run_labels(runs: list[Path]) -> list[str]:
    """Legend names: the folder name, or the path as given when two runs share a name
    (outputs/a/debug and outputs/b/debug)."""
    dirs = [r.parent if r.is_file() else r for r in runs]
    names = [d.resolve().name for d in dirs]
    if len(set(names)) == len(names):
        return names
    return [str(d) for d in dirs]


def build_figure(runs: dict[str, dict[int, dict]], dpi: float = 90, x: str = "step"):
    """A grid with one panel per quantity some run logged, against `x` (step or tokens); `runs`
    maps a run's label to its records by step."""
    # Figure and the Agg canvas directly, not pyplot: no display, no global figure state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    def logged(key):
        return any(series_points(records, key, x)[0] for records in runs.values())

    panels = [p for p in PANELS if any(logged(s.key) for s in p.series)] + source_panel(runs)
    if not panels:
        keys = ", ".join(sorted(PLOTTED_KEYS))
        raise MetricsError(f"no run logged any value to plot (looked for: {keys})")
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(4 * ncols, 3 * nrows + 0.4), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ax.set_title(panel.title)
        ax.set_xlabel("step" if x == "step" else "tokens seen")
        ax.grid(alpha=0.3)
        drawn = [s for s in panel.series if logged(s.key)]
        for color, records in zip(colors, runs.values()):
            for s in drawn:
                xs, values = series_points(records, s.key, x)
                if xs:  # a run that never logged this key gets no line, not an empty one
                    ax.plot(xs, values, s.style, marker=s.marker, markersize=3, color=color)
        if len(drawn) > 1:  # which line is which: the colours are the runs, styles the series
            handles = [Line2D([], [], color="0.3", ls=s.style, marker=s.marker) for s in drawn]
            ax.legend(handles, [s.label for s in drawn], fontsize="small")
    handles = [Line2D([], [], color=c) for c in colors]
    fig.legend(handles, list(runs), loc="outside upper center", ncols=min(len(runs), 4))
    return fig


def check_tokens_seen(runs: dict[str, dict[int, dict]]) -> None:
    for label, records in runs.items():
        if not any(r.get("tokens_seen") is not None for r in records.values()):
            raise MetricsError(
                f"{label}: no tokens_seen in its metrics (a run older than that key): plot it "
                "against the step (--x step)"
            )


def panel_titles(fig) -> list[str]:
    """The titles of the figure's panels, in drawing order (what the tests check)."""
    return [ax.get_title() for ax in fig.axes]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="a job.dump_folder")
    p.add_argument("-o", "--output", type=Path, default=Path("curves.png"), help="image to write")
    p.add_argument("--dpi", type=float, default=90, help="resolution of the image (default 90)")
    p.add_argument("--x", choices=list(X_KEYS), default="step", help="x axis (default step)")
    a = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_metrics: error: needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    try:
        runs = dict(zip(run_labels(a.runs), (load_run(r) for r in a.runs)))
        if a.x == "tokens":
            check_tokens_seen(runs)
        fig = build_figure(runs, a.dpi, a.x)
        try:
            fig.savefig(a.output)
        except OSError as e:
            raise MetricsError(f"{a.output}: cannot write the image ({e.strerror})") from None
    except MetricsError as e:
        print(f"plot_metrics: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.output}: {', '.join(panel_titles(fig))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
