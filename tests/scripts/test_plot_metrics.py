"""scripts/plot_metrics.py: the panels drawn from synthetic metrics.jsonl files, and bad input."""

import json
import sys

import pytest
from script_runner import load_script

pytest.importorskip("matplotlib")
from matplotlib.image import imread  # noqa: E402

plot = load_script("plot_metrics")

ALL_PANELS = [
    "loss",
    "learning rate",
    "grad norm",
    "tokens/s per device",
    "MFU (%)",
    "peak memory (GiB)",
    "data loading (% of step time)",
]


def record(step, **extra):
    """A record as MetricsLogger writes it on CPU: every standard key, extra ones appended."""
    values = {
        "loss": 8.0 - step / 10, "grad_norm": 1.0, "lr": 1e-4 * step, "wps": 3000.0,
        "tflops": 0.1, "mfu": 10.0, "memory_gib": 0.7, "alloc_retries": 0.0, "ooms": 0.0,
        "data_time_pct": 0.5, "elapsed_s": float(step),
    }  # fmt: skip
    return {"step": step, **values, **extra}


def write_run(folder, records):
    folder.mkdir(parents=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (folder / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


def test_two_runs_one_with_validation(tmp_path, capsys):
    plain = write_run(tmp_path / "plain", [record(s) for s in range(1, 11)])
    val = write_run(
        tmp_path / "with_val",
        [record(s, **({"val_loss": 7.0, "val_ppl": 1096.6} if s % 5 == 0 else {})) for s in
         range(1, 11)],
    )  # fmt: skip
    out = tmp_path / "curves.png"
    assert plot.main([str(plain), str(val), "-o", str(out), "--dpi", "50"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: loss, learning rate")
    image = imread(out)
    # 4 columns x 2 rows of 4 x 3 inch panels (+ the legend strip) at 50 dpi, RGBA
    assert image.shape == (320, 800, 4)
    assert image[..., :3].std() > 0.05  # something was drawn, not a blank canvas

    fig = plot.build_figure({"plain": plot.load_run(plain), "with_val": plot.load_run(val)})
    assert plot.panel_titles(fig) == ALL_PANELS
    loss = fig.axes[0]
    assert len(loss.lines) == 3  # train for both runs, validation for the one that ran it
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["train", "validation"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["plain", "with_val"]
    colors = {line.get_color() for line in loss.lines}
    assert len(colors) == 2  # one colour per run


def test_a_key_no_run_logged_drops_its_panel(tmp_path):
    # MFU is null without a known peak; no validation: the loss panel has train lines only.
    run = write_run(tmp_path / "run", [record(s, mfu=None) for s in range(1, 6)])
    fig = plot.build_figure({"run": plot.load_run(run)})
    assert plot.panel_titles(fig) == [t for t in ALL_PANELS if t != "MFU (%)"]
    assert len(fig.axes[0].lines) == 1 and fig.axes[0].get_legend() is None


def test_resumed_run_later_record_wins_and_validation_only_records_merge(tmp_path):
    run = write_run(
        tmp_path / "run",
        [
            record(1), record(2, loss=5.0),
            {"step": 3, "val_loss": 6.0, "val_ppl": 403.4},  # validation due, logging not
            record(2, loss=4.0),  # resumed from a step-1 checkpoint: step 2 logged again
        ],
    )  # fmt: skip
    records = plot.load_run(run)
    assert list(records) == [1, 2, 3]
    assert records[2]["loss"] == 4.0
    assert plot.series_points(records, "loss") == ([1, 2], [7.9, 4.0])
    assert plot.series_points(records, "val_loss") == ([3], [6.0])


def test_a_metrics_jsonl_path_is_accepted_and_same_named_runs_get_their_paths(tmp_path):
    a = write_run(tmp_path / "a" / "debug", [record(1)])
    b = write_run(tmp_path / "b" / "debug", [record(1)])
    assert plot.run_labels([a / "metrics.jsonl", b]) == [str(a), str(b)]
    assert plot.metrics_file(a / "metrics.jsonl") == a / "metrics.jsonl"


def error_of(capsys, argv):
    assert plot.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_run_dir_without_metrics(tmp_path, capsys):
    (tmp_path / "ckpt_only").mkdir()
    err = error_of(capsys, [str(tmp_path / "ckpt_only"), "-o", str(tmp_path / "x.png")])
    assert err == (
        f"plot_metrics: error: {tmp_path / 'ckpt_only' / 'metrics.jsonl'}: not found; pass a "
        "job.dump_folder (the folder train.py wrote metrics.jsonl into)"
    )
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "lines, message",
    [
        ([json.dumps(record(1)), ""], ":2: empty line (expected one JSON object per line)"),
        ([json.dumps(record(1)), '{"step": 2, "loss": 7.'], ":2: not valid JSON ("),
        (["[1, 2]"], ":1: expected a JSON object with an integer 'step'"),
        (['{"loss": 1.0}'], ":1: expected a JSON object with an integer 'step'"),
        ([json.dumps(record(1, lr="high"))], ":1: lr is 'high', expected a number or null"),
        ([], ": empty (no step logged yet)"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, capsys, lines, message):
    run = write_run(tmp_path / "run", lines)
    err = error_of(capsys, [str(run), "-o", str(tmp_path / "x.png")])
    assert err.startswith(f"plot_metrics: error: {run / 'metrics.jsonl'}{message}")


def test_nothing_to_plot(tmp_path, capsys):
    run = write_run(tmp_path / "run", [{"step": 1, "elapsed_s": 1.0}])
    err = error_of(capsys, [str(run), "-o", str(tmp_path / "x.png")])
    assert err.startswith("plot_metrics: error: no run logged any value to plot (looked for: ")


def test_unwritable_output(tmp_path, capsys):
    run = write_run(tmp_path / "run", [record(1)])
    out = tmp_path / "no_such_dir" / "x.png"
    err = error_of(capsys, [str(run), "-o", str(out)])
    assert err.startswith(f"plot_metrics: error: {out}: cannot write the image (")


def test_without_matplotlib_it_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", [record(1)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises
    err = error_of(capsys, [str(run), "-o", str(tmp_path / "x.png")])
    assert err == "plot_metrics: error: needs matplotlib: pip install matplotlib"


def test_against_tokens_seen_runs_of_two_batch_sizes_share_one_axis(tmp_path, capsys):
    small = write_run(tmp_path / "small", [record(s, tokens_seen=256.0 * s) for s in range(1, 5)])
    big = write_run(tmp_path / "big", [record(s, tokens_seen=512.0 * s) for s in range(1, 5)])
    runs = {"small": plot.load_run(small), "big": plot.load_run(big)}
    fig = plot.build_figure(runs, dpi=50, x="tokens")
    loss = fig.axes[0]
    assert loss.get_xlabel() == "tokens seen"
    assert [list(line.get_xdata()) for line in loss.get_lines()] == [
        [256.0, 512.0, 768.0, 1024.0],
        [512.0, 1024.0, 1536.0, 2048.0],
    ]
    out = tmp_path / "tokens.png"
    assert plot.main([str(small), str(big), "-o", str(out), "--x", "tokens"]) == 0
    assert out.is_file()
    # A run whose metrics lack tokens_seen cannot be put on that axis: said, not drawn empty.
    old = write_run(tmp_path / "old", [record(s) for s in range(1, 5)])
    capsys.readouterr()
    assert plot.main([str(small), str(old), "-o", str(tmp_path / "x.png"), "--x", "tokens"]) == 2
    assert "old: no tokens_seen in its metrics" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_a_mixture_run_gets_a_tokens_per_source_panel(tmp_path):
    seen = {"tokens_seen/web": 60.0, "tokens_seen/code": 25.0, "tokens_seen/math": 15.0}
    run = write_run(
        tmp_path / "mix", [record(s, **{k: v * s for k, v in seen.items()}) for s in (1, 2)]
    )
    fig = plot.build_figure({"mix": plot.load_run(run)})
    assert plot.panel_titles(fig) == [*ALL_PANELS, "tokens per source"]
    labels = [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]
    assert labels == ["code", "math", "web"]


def test_a_mixture_run_gets_a_loss_per_source_panel(tmp_path):
    """loss/<name> a line per source, val_loss/<name> (where validated) dotted beside it."""
    losses = {"loss/web": 5.0, "loss/math": 3.0}
    records = [record(s, **losses, **({"val_loss/math": 2.5} if s == 2 else {})) for s in (1, 2)]
    fig = plot.build_figure({"mix": plot.load_run(write_run(tmp_path / "mix", records))})
    assert plot.panel_titles(fig) == [*ALL_PANELS, "loss per source"]
    labels = [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]
    assert labels == ["math", "math (validation)", "web"]
    lines = fig.axes[-1].get_lines()
    assert [list(line.get_ydata()) for line in lines] == [[3.0, 3.0], [2.5], [5.0, 5.0]]
