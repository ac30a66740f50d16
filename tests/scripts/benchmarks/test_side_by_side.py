"""scripts/benchmarks/side_by_side.py: both consoles parse, the medians, ratios and goal are right
on recorded lines, bad options are one line, the GPU shapes given to torchtitan are Llama's, and
(slow) the CPU smoke runs titanlite and the installed torchtitan v0.2.2 end to end on one shape.
Also missing_wheels.py and side_by_side_cpu.py's device-type replacement."""

import json
import sys
import types

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
import missing_wheels  # noqa: E402
import side_by_side as sbs  # noqa: E402
import side_by_side_cpu  # noqa: E402

# Recorded from the smoke mode (the stamp: seconds since the run's start), steps 3-5 shortened.
TITANLITE = """\
17.469 [r0] 01:54:03 INFO model llama3 debugmodel_2L: 2,032,896 parameters, vocab 640, world 1
18.554 [r0] 01:54:04 INFO step     1  loss  6.8677  grad_norm  1.51  lr 1.1e-04  wps 433  tflops 0.0052  mfu 5.14%  mem 0.50GiB  data 1.6%
19.000 [r0] 01:54:05 INFO step     2  loss  6.8  wps 500  mem 0.52GiB
19.500 [r0] 01:54:05 INFO step     3  loss  6.7  wps 500  mem 0.51GiB
20.000 [r0] 01:54:06 INFO step     4  loss  6.6  wps 500  mem 0.51GiB
20.500 [r0] 01:54:06 INFO step     5  loss  6.5  wps 500  mem 0.51GiB
20.700 [r0] 01:54:06 INFO step     6  loss  6.4  wps 640  mem 0.51GiB  active 0.40GiB
21.100 [r0] 01:54:07 INFO step     7  loss  6.3  wps 320  mem 0.51GiB  active 0.40GiB
"""  # noqa: E501
TORCHTITAN = """\
36.958 [titan] 2026-11-29 01:54:54,805 - root - INFO - Model llama3 side_by_side size: 2,032,896 total parameters
37.369 [rank0]:[titan] 2026-11-29 01:54:55,221 - root - INFO - step:  1  loss:  6.94368  grad_norm:  1.7711  memory:  0.52GiB(2.21%)  tps: 308  tflops: 0.00  mfu: 0.00%
37.651 [titan] 2026-11-29 01:54:55,503 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss:  6.98784  grad_norm:  1.9567  memory:  0.55GiB(2.22%)  tps: 1,453\x1b[39m
38.000 [titan] ... - INFO - step:  3  loss:  6.9  memory:  0.53GiB(2.22%)  tps: 400
38.500 [titan] ... - INFO - step:  4  loss:  6.9  memory:  0.53GiB(2.22%)  tps: 400
39.000 [titan] ... - INFO - step:  5  loss:  6.9  memory:  0.53GiB(2.22%)  tps: 400
39.400 [titan] ... - INFO - step:  6  loss:  6.8  memory:  0.53GiB(2.22%)  tps: 330
39.800 [titan] ... - INFO - step:  6  loss:  1.0  memory:  9.99GiB(2.22%)  tps: 1
40.000 [titan] ... - INFO - step:  7  loss:  6.7  memory:  0.53GiB(2.22%)  tps: 200
"""  # noqa: E501


def stamped(text: str) -> list[tuple[float, str]]:
    return [(float(t), line) for t, line in (row.split(" ", 1) for row in text.splitlines())]


def test_both_consoles_parse():
    tl = sbs.parse_console("titanlite", stamped(TITANLITE))
    tt = sbs.parse_console("torchtitan", stamped(TORCHTITAN))
    assert tl["params"] == tt["params"] == 2_032_896
    assert tl["steps"][1] == {"t": 18.554, "loss": 6.8677, "tps": 433.0, "mem": 0.50}
    assert tt["steps"][2] == {"t": 37.651, "loss": 6.98784, "tps": 1453.0, "mem": 0.55}
    assert tt["steps"][6]["loss"] == 6.8  # a step logged twice keeps its first line
    assert sorted(tl["steps"]) == sorted(tt["steps"]) == list(range(1, 8))


def test_measure_takes_medians_over_steps_6_on_and_the_peak_over_all():
    tl = sbs.measure("titanlite", stamped(TITANLITE), last=7, tokens_per_step=128)
    # step 6: 128 / 0.2 s, step 7: 128 / 0.4 s; own: wps 640, 320
    assert tl["tokens_per_s"] == pytest.approx((640 + 320) / 2)
    assert tl["own_tokens_per_s"] == 480 and tl["peak_gib"] == 0.52
    assert tl["loss_last"] == 6.3 and tl["params"] == 2_032_896
    tt = sbs.measure("torchtitan", stamped(TORCHTITAN), last=7, tokens_per_step=128)
    assert tt["tokens_per_s"] == pytest.approx((128 / 0.4 + 128 / 0.6) / 2)
    assert tt["own_tokens_per_s"] == 265 and tt["peak_gib"] == 0.55
    short = sbs.measure("titanlite", stamped(TITANLITE)[:-1], last=7, tokens_per_step=128)
    assert short["error"] == "no step line for step(s) [7]"


def test_summary_ratios_and_the_goal():
    def run(fw, rate, peak, rep=1, **extra):
        return {"shape": "s", "framework": fw, "repeat": rep, "tokens_per_s": rate,
                "own_tokens_per_s": rate, "peak_gib": peak, "params": 10, **extra}  # fmt: skip

    runs = [run("titanlite", 1200, 9.0), run("torchtitan", 1000, 10.0),
            run("titanlite", 1000, 9.0, rep=2), run("torchtitan", 1000, 10.0, rep=2),
            run("titanlite", 0, 0, rep=3, error="exit code 1")]  # fmt: skip
    row = sbs.summarize(runs, ["s"])["s"]
    assert row["titanlite"]["tokens_per_s"] == 1100 and row["titanlite"]["failed"] == 1
    assert row["ratio"] == pytest.approx(1.1) and row["memory_ratio"] == pytest.approx(0.9)
    assert row["goal_met"] is True and row["params_match"] is True
    more_memory = [run("titanlite", 2000, 10.5), run("torchtitan", 1000, 10.0)]
    assert sbs.summarize(more_memory, ["s"])["s"]["goal_met"] is False
    slower = [run("titanlite", 1050, 5.0), run("torchtitan", 1000, 10.0)]
    assert sbs.summarize(slower, ["s"])["s"]["goal_met"] is False
    one_sided = sbs.summarize(runs[:1], ["s"])["s"]
    assert one_sided["ratio"] is None and one_sided["goal_met"] is None
    cells = sbs.markdown_table(sbs.summarize(runs, ["s"])).splitlines()[2].split(" | ")
    assert cells == ["| s", "10 / 10", "1,100 (1 failed)", "1,000", "1.100", "9.00", "10.00",
                     "0.900", "met |"]  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        (["--cpu-smoke", "--shapes", "1B"], "--shapes does not apply to --cpu-smoke"),
        (["--shapes", "1B,70B"], "unknown shape(s) 70B; known: 8B_4L, 1B"),
        (["--steps", "6"], "--steps must be at least 7"),
        (["--repeats", "0"], "--repeats, --docs and --timeout must be positive"),
        (["--budget", "-1"], "--budget not negative"),
        (["--torchtitan", "/"], "--torchtitan '/' holds no torchtitan/train.py"),
        (["--python", "/no/python"], "--python '/no/python' is not an executable file"),
        (["--pythonpath", "/no/site"], "--pythonpath /no/site: not a folder"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(tmp_path, capsys, change, message):
    with pytest.raises(SystemExit) as e:
        sbs.main([*change, "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("side_by_side.py: error: ") and message in err[-1], err
    assert not (tmp_path / "out").exists()


def test_without_a_gpu_the_gpu_mode_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sbs.main(["--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        "side_by_side: no CUDA device here: run it on a GPU, or --cpu-smoke\n"
    )


def test_a_spent_budget_starts_no_run_and_says_so(tmp_path, capsys):
    out = tmp_path / "out"
    assert sbs.main(["--cpu-smoke", "--budget", "1", "--out", str(out)]) == 1
    result = json.loads((out / "side_by_side.json").read_text())
    assert [r["error"] for r in result["runs"]] == ["not run: 0 s of --budget left"] * 2
    assert result["summary"]["smoke"]["titanlite"]["failed"] == 1
    assert not (out / "logs" / "smoke_titanlite_r1.log").exists()


@pytest.mark.parametrize(
    "shape, fields, hidden",
    [
        ("8B_4L", {"dim": 4096, "n_layers": 4, "n_heads": 32, "n_kv_heads": 8,
                   "ffn_dim_multiplier": 1.3, "multiple_of": 1024}, 14336),
        ("1B", {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8,
                "ffn_dim_multiplier": 1.5, "multiple_of": 256}, 8192),
    ],
)  # fmt: skip
def test_torchtitan_gets_llamas_shapes_with_titanlites_vocabulary(tmp_path, shape, fields, hidden):
    argv = sbs.titanlite_args(sbs.SHAPES[shape], False, 25, tmp_path)
    found = sbs.torchtitan_shape(argv)
    common = {"vocab_size": 100_352, "norm_eps": 1e-5, "rope_theta": 500000.0}
    assert found["fields"] == {**fields, **common} and found["ffn_hidden"] == hidden
    assert found["tokenizer"].n_words == 100_277  # cl100k with its specials, padded to 100,352


def test_missing_wheels_lists_only_absent_distributions(tmp_path):
    for name in ("pytest-8.0.0-py3-none-any.whl", "Typing_Extensions-4.0.0-py3-none-any.whl",
                 "no_such_distribution_xyz-1.0-py3-none-any.whl", "notes.txt"):  # fmt: skip
        (tmp_path / name).write_text("")
    assert missing_wheels.missing(tmp_path) == [
        tmp_path / "no_such_distribution_xyz-1.0-py3-none-any.whl"
    ]


def test_the_cpu_launcher_rebinds_torchtitans_cuda_names(monkeypatch):
    module = types.ModuleType("torchtitan.some_module")
    module.device_type, module.device_module = "cuda", torch.cuda
    other = types.ModuleType("not_torchtitan")
    other.device_type = "cuda"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(sys.modules, other.__name__, other)
    assert "torchtitan.some_module" in side_by_side_cpu.rebind_device_type()
    assert (module.device_type, module.device_module) == ("cpu", torch.cpu)
    assert other.device_type == "cuda"


@pytest.mark.slow
def test_cpu_smoke_runs_both_frameworks_on_the_same_model(tmp_path, capsys):
    """titanlite and the installed torchtitan v0.2.2 (the dev extra), 7 steps each of the same
    2-layer model: both runs give figures, the parameter counts agree, each log is kept."""
    out = tmp_path / "out"
    assert sbs.main(["--cpu-smoke", "--out", str(out)]) == 0, capsys.readouterr()
    result = json.loads((out / "side_by_side.json").read_text())
    assert result["meta"]["torchtitan_version"] == "0.2.2"
    shape = result["meta"]["shapes"]["smoke"]["torchtitan_args"]
    assert (shape["dim"], shape["n_layers"], shape["vocab_size"]) == (256, 2, 640)
    row = result["summary"]["smoke"]
    assert row["params_match"] is True and row["titanlite"]["params"] == 2_032_896
    for fw in sbs.FRAMEWORKS:
        assert row[fw]["tokens_per_s"] > 0 and row[fw]["peak_gib"] > 0 and row[fw]["failed"] == 0
    assert row["ratio"] > 0 and row["goal_met"] in (True, False)
    tt_log = (out / "logs" / "smoke_torchtitan_r1.log").read_text()
    assert "Model llama3 side_by_side size" in tt_log and "selective activation" in tt_log
    assert "step     7" in (out / "logs" / "smoke_titanlite_r1.log").read_text()
    assert "| smoke | 2,032,896 / 2,032,896 |" in (out / "side_by_side.md").read_text()
