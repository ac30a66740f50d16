"""scripts/benchmarks/bench_torchtitan.py without torchtitan: bad inputs are one line and exit
code 2, step lines of both frameworks parse, the window's tokens/s and the medians and ratios are
right on a recorded sample; and torchtitan_cpu.py's CPU attention equals masked attention."""

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
import bench_data  # noqa: E402
import bench_torchtitan as bt  # noqa: E402
import torchtitan_cpu  # noqa: E402

# Recorded from a smoke run (8 steps; the stamp is seconds since the run's start).
TITANLITE_LOG = """\
[r0] 13:54:20 INFO model llama3 debugmodel: 6,163,712 parameters, vocab 2048, world 1 ParallelDims(...)
[r0] 13:54:21 INFO training from step 0 to 8
[r0] 13:54:27 INFO step     1  loss  8.2160  grad_norm 0.638  lr 4.0e-04  wps 347  tflops 0.0134  mfu 10.39%  mem 0.87GiB  data 0.1%
[r0] 13:54:30 INFO step     2  loss  8.0673  grad_norm  1.07  lr 8.0e-04  wps 746  tflops 0.0289  mfu 22.36%  mem 0.97GiB  data 0.0%
[r0] 13:54:31 INFO step     3  loss  8.0477  grad_norm  0.63  lr 8.0e-04  wps 1,202  tflops 0.0466  mfu 36.04%  mem 0.99GiB
[r0] 13:54:33 INFO step     4  loss  7.8235  grad_norm 0.654  lr 4.0e-04  wps 1,471  tflops 0.057  mfu 44.11%  mem 0.98GiB
[r0] 13:54:34 INFO step     5  loss  7.6000  grad_norm 0.654  lr 4.0e-04  wps 2,000  tflops 0.057  mfu 44.11%  mem 0.98GiB
[r0] 13:54:35 INFO step     6  loss  7.5000  grad_norm 0.654  lr 4.0e-04  wps 2,100  tflops 0.057  mfu 44.11%  mem 0.98GiB
[r0] 13:54:36 INFO step     7  loss  7.4000  grad_norm 0.654  lr 4.0e-04  wps 2,200  tflops 0.057  mfu 44.11%  mem 0.98GiB
[r0] 13:54:37 INFO step     8  loss  7.3000  grad_norm 0.654  lr 4.0e-04  wps 2,300  tflops 0.057  mfu 44.11%  mem 0.98GiB
"""  # noqa: E501
TORCHTITAN_LOG = """\
[titan] 2026-11-26 13:52:43,429 - root - INFO - Model llama3 debugmodel size: 6,163,712 total parameters
[titan] 2026-11-26 13:53:31,084 - root - INFO - step:  1  loss:  8.03677  grad_norm:  1.3775  memory:  1.22GiB(5.20%)  tps: 43  tflops: 0.00  mfu: 0.00%
[titan] 2026-11-26 13:53:44,476 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss:  7.80865  grad_norm:  1.2735  memory:  1.32GiB(5.61%)  tps: 153  tflops: 0.01  mfu: 0.00%\x1b[39m
[titan] 2026-11-26 13:53:56,625 - root - INFO - step:  3  loss:  7.51115  grad_norm:  1.3031  memory:  1.40GiB(5.93%)  tps: 169  tflops: 0.01  mfu: 0.00%
[titan] 2026-11-26 13:54:02,975 - root - INFO - step:  4  loss:  6.97118  grad_norm:  1.7074  memory:  1.40GiB(5.93%)  tps: 323  tflops: 0.01  mfu: 0.00%
[titan] 2026-11-26 13:54:03,975 - root - INFO - step:  5  loss:  6.90000  grad_norm:  1.7074  memory:  1.40GiB(5.93%)  tps: 2,000  tflops: 0.01  mfu: 0.00%
[titan] 2026-11-26 13:54:04,975 - root - INFO - step:  6  loss:  6.80000  grad_norm:  1.7074  memory:  1.40GiB(5.93%)  tps: 2,000  tflops: 0.01  mfu: 0.00%
[titan] 2026-11-26 13:54:05,975 - root - INFO - step:  6  loss:  6.80000  grad_norm:  1.7074  memory:  1.40GiB(5.93%)  tps: 2,000  tflops: 0.01  mfu: 0.00%
[titan] 2026-11-26 13:54:06,975 - root - INFO - step:  7  loss:  6.70000  grad_norm:  1.7074  memory:  1.40GiB(5.93%)  tps: 1,900  tflops: 0.01  mfu: 0.00%
[titan] 2026-11-26 13:54:07,975 - root - INFO - step:  8  loss:  6.60000  grad_norm:  1.7074  memory:  1.40GiB(5.93%)  tps: 1,800  tflops: 0.01  mfu: 0.00%
"""  # noqa: E501


def stamped(log: str, times: list[float]) -> list[tuple[float, str]]:
    return list(zip(times, log.splitlines()))


def test_step_lines_of_both_frameworks_parse():
    tl = TITANLITE_LOG.splitlines()
    assert bt.parse_step_line("titanlite", tl[4]) == (3, 8.0477, 1202.0)
    assert bt.parse_step_line("titanlite", tl[1]) is None  # "training from step 0 to 8"
    tt = TORCHTITAN_LOG.splitlines()
    assert bt.parse_step_line("torchtitan", tt[2]) == (2, 7.80865, 153.0)  # colours dropped
    assert bt.parse_step_line("torchtitan", tl[4]) is None
    assert bt.parse_step_line("titanlite", tt[2]) is None


def test_a_run_measures_the_window_after_step_5():
    # titanlite: step k's line at 10 + k seconds; 2 ranks -> 4,096 tokens a step
    times = [1.0, 2.0] + [10.0 + k for k in range(1, 9)]
    m = bt.measure("titanlite", stamped(TITANLITE_LOG, times), last=8, tokens_per_step=4096)
    assert m["tokens_per_s"] == pytest.approx(3 * 4096 / 3.0)  # step 5 at 15 s, step 8 at 18 s
    assert m["losses"] == {1: 8.216, 3: 8.0477, 8: 7.3}  # steps 1, 8 - 5, 8
    assert m["own_tps_median"] == 2200.0  # over steps 6-8
    assert m["params"] == 6_163_712
    # torchtitan: step 6 logged twice keeps its first line; step 5 at 40 s, step 8 at 46 s
    times = [1.0, 10.0, 20.0, 30.0, 38.0, 40.0, 41.0, 45.0, 45.5, 46.0]
    m = bt.measure("torchtitan", stamped(TORCHTITAN_LOG, times), last=8, tokens_per_step=2048)
    assert m["tokens_per_s"] == pytest.approx(3 * 2048 / 6.0)
    assert m["losses"] == {1: 8.03677, 3: 7.51115, 8: 6.6}
    assert m["own_tps_median"] == 1900.0


def test_a_run_without_its_step_lines_is_an_error_not_a_figure():
    lines = TITANLITE_LOG.splitlines()[:6]  # up to step 4: it died
    m = bt.measure("titanlite", stamped("\n".join(lines), list(range(6))), 8, 2048)
    assert "no step line for step(s) [5, 8]" in m["error"]
    assert bt.loss_steps(25) == [1, 20, 25]


def run(config, fw, rate, losses=None, rep=1):
    return {"config": config, "framework": fw, "repeat": rep, "tokens_per_s": rate,
            "losses": losses or {1: 8.0, 20: 4.0, 25: 3.5}, "params": 6_163_712}  # fmt: skip


def test_medians_ratios_table_and_result_line():
    runs = [
        run("dp1_fp32", "titanlite", 2400.0), run("dp1_fp32", "torchtitan", 2000.0),
        run("dp1_fp32", "titanlite", 2600.0, rep=2), run("dp1_fp32", "torchtitan", 2200.0, rep=2),
        run("dp1_fp32", "titanlite", 3000.0, rep=3), run("dp1_fp32", "torchtitan", 1000.0, rep=3),
        run("fsdp2_bf16", "titanlite", 5000.0, {1: 8.0, 20: 4.0, 25: 3.4}),
        run("fsdp2_bf16", "titanlite", 4000.0, rep=2),
        {"config": "fsdp2_bf16", "framework": "torchtitan", "repeat": 1, "error": "exit code 1"},
    ]  # fmt: skip
    s = bt.summarize(runs, ["dp1_fp32", "fsdp2_bf16"])
    assert s["dp1_fp32"]["titanlite"]["median"] == 2600.0
    assert s["dp1_fp32"]["torchtitan"]["median"] == 2000.0
    assert s["dp1_fp32"]["ratio"] == pytest.approx(1.3)
    assert not s["dp1_fp32"]["titanlite"]["losses_vary"]
    assert s["fsdp2_bf16"]["titanlite"]["median"] == 4500.0
    assert s["fsdp2_bf16"]["titanlite"]["losses_vary"]
    assert s["fsdp2_bf16"]["torchtitan"] | {"runs": None} == {
        "median": None, "runs": None, "failed": 1, "losses": None, "losses_vary": False,
        "params": None,
    }  # fmt: skip
    assert s["fsdp2_bf16"]["ratio"] is None
    table = bt.markdown_table(s, 25).splitlines()
    assert "titanlite loss @1/@20/@25" in table[0]
    assert table[2] == (
        "| dp1_fp32 | 1 x 2 | 2,600 (2,400 / 2,600 / 3,000) | 2,000 (2,000 / 2,200 / 1,000) "
        "| 1.30 | 8.0000 / 4.0000 / 3.5000 | 8.0000 / 4.0000 / 3.5000 |"
    )
    assert "| fsdp2_bf16 | 2 x 1 |" in table[3] and "failed (1)" in table[3]
    assert "(vary)" in table[3]
    line = bt.result_line(s)
    assert line.startswith("RESULT ") and "\n" not in line
    assert json.loads(line.removeprefix("RESULT ")) == {
        "dp1_fp32": {"titanlite": 2600.0, "torchtitan": 2000.0, "ratio": 1.3},
        "fsdp2_bf16": {"titanlite": 4500.0, "torchtitan": None, "ratio": None},
    }


@pytest.fixture
def fake_setup(tmp_path):
    checkout = tmp_path / "tt"
    (checkout / "torchtitan").mkdir(parents=True)
    (checkout / "torchtitan" / "train.py").write_text("")
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'No module named tyro' >&2\nexit 1\n")
    python.chmod(0o755)
    return ["--torchtitan", str(checkout), "--torchtitan-python", str(python)]


@pytest.mark.parametrize(
    "change, message",
    [
        (["--torchtitan", "/no/such/folder"], "--torchtitan '/no/such/folder' is not a folder"),
        (["--torchtitan", "/"], "is not a torchtitan checkout (no torchtitan/train.py in it)"),
        (["--torchtitan-python", "/no/python"], "'/no/python' is not an executable file"),
        (["--configs", "dp1_fp32,dp3"], "unknown config(s) dp3; known: dp1_fp32, dp1_bf16"),
        (["--steps", "6"], "--steps must be at least 7"),
        (["--repeats", "0"], "--repeats, --docs and --timeout must be positive"),
        (["--data", "/no/corpus.jsonl"], "--data '/no/corpus.jsonl' is not a file"),
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    ],
)
def test_bad_inputs_are_one_line_and_exit_2(fake_setup, tmp_path, capsys, change, message):
    with pytest.raises(SystemExit) as e:
        bt.main([*fake_setup, *change, "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("bench_torchtitan.py: error: ") and message in last, err
    assert not (tmp_path / "out").exists()


def test_a_torchtitan_venv_that_cannot_start_is_one_line(fake_setup, tmp_path, capsys):
    assert bt.main([*fake_setup, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("No module named tyro")
    assert err[0].startswith("bench_torchtitan: torchtitan does not start with ")


def test_the_corpus_carries_c4s_fields(tmp_path):
    path = tmp_path / "c4.jsonl"
    bench_data.write_corpus(path, docs=3, doc_chars=200, c4_fields=True)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3 and all(set(r) == {"text", "timestamp", "url"} for r in rows)
    assert rows[0]["url"].startswith("stdlib://") and rows[1]["url"].endswith(
        f"#{len(rows[0]['text'])}"
    )


def test_document_spans_accepts_causal_spans_only():
    t = 7
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    i = torch.arange(t)
    mask = (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])
    assert torchtitan_cpu.document_spans(mask) == [(0, 3), (3, 5), (5, 7)]
    causal = i[:, None] >= i[None, :]
    assert torchtitan_cpu.document_spans(causal) == [(0, 7)]
    sliding = causal & (i[:, None] - i[None, :] < 2)  # not a span structure
    assert torchtitan_cpu.document_spans(sliding) is None
    assert torchtitan_cpu.document_spans(mask.T.contiguous()) is None  # anti-causal


def test_span_attention_equals_masked_attention():
    torch.manual_seed(0)
    n, t, h = 4, 12, 8
    q, k, v = (torch.randn(n, t, h) for _ in range(3))
    doc = torch.tensor([0] * 5 + [1] * 4 + [2] * 3)
    i = torch.arange(t)
    mask = (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    spans = torchtitan_cpu.document_spans(mask)
    torch.testing.assert_close(torchtitan_cpu.spans_attention(q, k, v, spans), expected)
    torch.testing.assert_close(torchtitan_cpu.spans_attention(q, k, v, mask), expected)
