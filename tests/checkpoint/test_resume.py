"""Checkpoint resume through train.py, end to end: bitwise under FSDP x TP, resharding across
layouts and dp degrees, async vs sync, excluded parts, preemption signals.

Every run uses the debug model at toy sizes (seq 32, global batch 8, fp32) and trains 12 steps
with a checkpoint at 6. "Resume from step 6" means copying a reference run's step-6 folder into a
fresh dump folder and rerunning with the same config: the state at step 6 is exactly what a run
that stopped there would have left, and the LR schedule (which depends on training.steps) is the
same as the reference's. Reference runs are module fixtures so each runs once.
"""

import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_TRAIN, assert_nested_equal, read_jsonl, train_many
from integration.parity import PP_WHOLE_BATCH, one_microbatch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titanlite.checkpoint import scan_checkpoints

TINY = [
    *TINY_TRAIN,
    "--checkpoint.enable",
    "--checkpoint.interval", "6",
    "--training.steps", "12",
]  # fmt: skip
# (nproc, extra args). The global batch of 8 is 1-4 microbatches, so a resume may also change the
# accumulation: local batch 2, except that layouts with TP or CP take a rank's whole share in one
# microbatch (their collectives per microbatch are most of a step's time on 2 cores) and, with
# PP, in one schedule run of 2-row pipeline microbatches.
LAYOUTS = {
    "one": (1, []),
    "fsdp2": (2, []),
    "fsdp4": (4, []),
    "fsdp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2", *one_microbatch(2)]),
    "cp2_fsdp2": (4, ["--parallelism.context_parallel_degree", "2", *one_microbatch(2)]),
    "pp2_fsdp2": (4, ["--parallelism.pipeline_parallel_degree", "2"]),
    "pp2_tp2": (4, ["--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.tensor_parallel_degree", "2", *PP_WHOLE_BATCH]),
    "pp2_cp2": (4, ["--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.context_parallel_degree", "2", *PP_WHOLE_BATCH]),
}  # fmt: skip


def train(out: Path, layout: str, *extra: str):
    nproc, args = LAYOUTS[layout]
    return train_many([[*TINY, *args, *extra, "--job.dump_folder", str(out)]], nproc=nproc)


def resume(ref: Path, out: Path, layout: str, *extra: str):
    """Rerun `layout` in `out`, starting from the reference run's step-6 checkpoint."""
    shutil.copytree(ref / "checkpoint" / "step-6", out / "checkpoint" / "step-6")
    return train(out, layout, *extra)


def metrics(folder: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_jsonl(folder / "metrics.jsonl")}


def load_full(step_dir: Path, tmp: Path) -> dict:
    """A DCP checkpoint as one plain dict of full tensors and blobs, whatever layout wrote it."""
    dst = tmp / f"{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(dst))
    return torch.load(dst, weights_only=False)


def job(out: Path, name: str, layout: str, *extra: str, start: Path | None = None) -> list:
    """train_many's jobs for one run of `layout` in out/name, started from `start`'s step 6."""
    run = [[*TINY, *LAYOUTS[layout][1], *extra, "--job.dump_folder", str(out / name)]]
    if start is None:
        return run
    step6 = [str(folder / "checkpoint" / "step-6") for folder in (start, out / name)]
    return [{"copy": step6}, *run]


# The 4-rank resumes of test_reshard_resume, run with the references below.
RESHARD_4 = [("fsdp4_ref", "fsdp2_tp2"), ("fsdp4_ref", "cp2_fsdp2"), ("cp_ref", "fsdp2_tp2")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every 4-rank run of this file in one torchrun launch (process start-up is most of a tiny
    run's time on 2 cores), each in its own folder:
    - fsdp4_ref: an uninterrupted FSDP 4 run, sync checkpoints at 6 and 12;
    - tp_ref: an uninterrupted FSDP 2 x TP 2 run, async checkpoints at 6 and 12, and tp_resumed:
      it resumed from its (async-written) step 6, saving step 12 synchronously;
    - cp_ref: an uninterrupted CP 2 x FSDP 2 run, sync checkpoints;
    - "{ref}-{layout}": ref's step 6 resumed under layout, for RESHARD_4;
    - pp/ref: an uninterrupted PP 2 x FSDP 2 run; pp/same, pp/fsdp4, pp/pp2_tp2: its step 6
      resumed under PP 2 x FSDP 2, FSDP 4 and PP 2 x TP 2; pp/from_fsdp4: fsdp4_ref's step 6
      under PP 2 x TP 2;
    - ppcp/ref: an uninterrupted PP 2 x CP 2 run; ppcp/fsdp4: its step 6 under FSDP 4;
      ppcp/from_fsdp4: fsdp4_ref's step 6 under PP 2 x CP 2."""
    out = tmp_path_factory.mktemp("runs")
    jobs = job(out, "fsdp4_ref", "fsdp4") + job(out, "cp_ref", "cp2_fsdp2")
    jobs += job(out, "tp_ref", "fsdp2_tp2", "--checkpoint.async_mode", "async")
    jobs += job(out, "tp_resumed", "fsdp2_tp2", start=out / "tp_ref")
    for ref, layout in RESHARD_4:
        jobs += job(out, f"{ref}-{layout}", layout, start=out / ref)
    pp = out / "pp"
    jobs += job(pp, "ref", "pp2_fsdp2") + job(pp, "same", "pp2_fsdp2", start=pp / "ref")
    jobs += job(pp, "fsdp4", "fsdp4", start=pp / "ref")
    jobs += job(pp, "pp2_tp2", "pp2_tp2", start=pp / "ref")
    jobs += job(pp, "from_fsdp4", "pp2_tp2", start=out / "fsdp4_ref")
    ppcp = out / "ppcp"
    jobs += job(ppcp, "ref", "pp2_cp2") + job(ppcp, "fsdp4", "fsdp4", start=ppcp / "ref")
    jobs += job(ppcp, "from_fsdp4", "pp2_cp2", start=out / "fsdp4_ref")
    train_many(jobs, nproc=4)
    return out


@pytest.fixture(scope="module")
def fsdp4_ref(runs) -> Path:
    return runs / "fsdp4_ref"


@pytest.fixture(scope="module")
def tp_ref(runs) -> Path:
    return runs / "tp_ref"


@pytest.fixture(scope="module")
def tp_resumed(runs) -> Path:
    return runs / "tp_resumed"


@pytest.mark.slow
def test_fsdp_tp_resume_is_bitwise(tp_ref, tp_resumed):
    """4 ranks, FSDP 2 x TP 2: steps 7-12 after a resume are the very same floats."""
    for key in ("loss", "grad_norm", "lr"):
        a, b = metrics(tp_ref, key), metrics(tp_resumed, key)
        assert sorted(b) == list(range(7, 13)), key
        assert {s: a[s] for s in b} == b, key  # ==, not approx


@pytest.mark.slow
def test_async_checkpoint_equals_sync_checkpoint(tp_ref, tp_resumed, tmp_path):
    """The async save (tp_ref) and the sync save (tp_resumed) of step 12 hold identical values for
    every part except the wall-clock `elapsed_s`; and tp_resumed resumed bitwise from an async
    checkpoint (previous test), so async and sync are interchangeable."""
    a = load_full(tp_ref / "checkpoint" / "step-12", tmp_path)
    b = load_full(tp_resumed / "checkpoint" / "step-12", tmp_path)
    assert set(a) == set(b)
    for part in ("train_state", "lr_scheduler", "dataloader", "meta"):
        a[part], b[part] = pickle.loads(a[part]), pickle.loads(b[part])
    for rng in (a["rng"], b["rng"]):  # compared as values: pickle bytes depend on object identity
        rng.update({k: pickle.loads(v) for k, v in rng.items()})
    a["train_state"].pop("elapsed_s"), b["train_state"].pop("elapsed_s")
    assert a["train_state"]["step"] == 12 and a["dataloader"]["step"] == 12
    assert_nested_equal(a, b)
    assert sorted(a["rng"]) == [f"rank{r}" for r in range(4)]  # each rank's RNG states


@pytest.mark.slow
@pytest.mark.parametrize(
    "ref, layout",
    [
        ("fsdp4_ref", "fsdp2_tp2"),
        ("fsdp4_ref", "one"),
        ("fsdp4_ref", "fsdp2"),
        ("fsdp4_ref", "cp2_fsdp2"),
        ("cp_ref", "fsdp2_tp2"),
    ],
)
def test_reshard_resume(ref, layout, tmp_path, runs):
    """An FSDP 4 checkpoint resumes under FSDP 2 x TP 2, one process, FSDP 2 on 2 processes and
    CP 2 x FSDP 2; a CP 2 x FSDP 2 one under FSDP 2 x TP 2. The loader position is global, so
    step 7 sees the same global batch: its loss matches the uninterrupted run to reduction-order
    rounding, as do the later steps."""
    if (ref, layout) in RESHARD_4:
        resumed = runs / f"{ref}-{layout}"
    else:
        resumed = tmp_path
        resume(runs / ref, resumed, layout)
    a, b = metrics(runs / ref), metrics(resumed)
    assert sorted(b) == list(range(7, 13))
    devs = {s: abs(a[s] - b[s]) / abs(a[s]) for s in b}
    print(f"{layout}: relative loss deviation per step {devs}")
    # Step 7: bitwise-identical weights, the same batch, another layout: only the fp32 reduction
    # order differs. The loss sums <= 256 positive per-token losses (8 rows x 32), and two orders
    # differ by <= 2 x 255u = 3.0e-5 of it (u = 2**-24; about 2 sqrt(256) u = 1.9e-6 typically).
    # Measured 7.6e-8 (one ulp). A different batch moves it ~1e-2.
    assert devs[7] < 5e-5, devs
    # Later steps also carry the layouts' weight rounding differences, which a smooth loss feels
    # only slightly (measured <= 8.5e-8 over steps 8-12).
    assert max(devs.values()) < 1e-4, devs


@pytest.mark.slow
def test_pp_resume_is_bitwise(runs):
    for key in ("loss", "grad_norm", "lr"):
        a, b = metrics(runs / "pp" / "ref", key), metrics(runs / "pp" / "same", key)
        assert sorted(b) == list(range(7, 13)), key
        assert {s: a[s] for s in b} == b, key


@pytest.mark.slow
@pytest.mark.parametrize(
    "ref, run",
    [
        ("pp/ref", "pp/fsdp4"),
        ("pp/ref", "pp/pp2_tp2"),
        ("fsdp4_ref", "pp/from_fsdp4"),
        ("ppcp/ref", "ppcp/fsdp4"),
        ("fsdp4_ref", "ppcp/from_fsdp4"),
    ],
)
def test_pp_checkpoints_reshard_both_ways(ref, run, runs):
    """State-dict keys do not depend on the layout: a PP 2 x FSDP 2 checkpoint continues under
    FSDP 4 and PP 2 x TP 2, an FSDP 4 one under PP 2 x TP 2, a PP 2 x CP 2 one under FSDP 4 and
    back, each within reduction-order rounding of the uninterrupted run (measured <= 1.6e-7)."""
    a, b = metrics(runs / ref), metrics(runs / run)
    assert sorted(b) == list(range(7, 13))
    devs = {s: abs(a[s] - b[s]) / abs(a[s]) for s in b}
    print(f"{run}: relative loss deviation per step {devs}")
    assert max(devs.values()) < 1e-5, devs


@pytest.mark.slow
def test_exclude_dataloader_restarts_the_data(fsdp4_ref, tmp_path):
    """`exclude_from_loading dataloader`: weights, optimizer, schedule and step are restored, the
    data stream starts again from its first batch (what a changed dataset or batch needs), and
    the log says so."""
    proc = resume(fsdp4_ref, tmp_path, "one", "--checkpoint.exclude_from_loading", "dataloader")
    log = proc.stdout + proc.stderr
    assert "dataloader not loaded" in log and "first batch" in log, log[-3000:]
    a, b = metrics(fsdp4_ref), metrics(tmp_path)
    assert sorted(b) == list(range(7, 13))
    assert abs(a[7] - b[7]) > 1e-3 * abs(a[7])  # other data than the reference's step 7
    assert metrics(tmp_path, "lr") == {s: metrics(fsdp4_ref, "lr")[s] for s in b}
    saved = load_full(tmp_path / "checkpoint" / "step-12", tmp_path)
    assert pickle.loads(saved["dataloader"])["step"] == 6  # 6 batches since the restart
    assert pickle.loads(saved["train_state"])["step"] == 12


def _wait_for(pred, proc, seconds=120):
    for _ in range(int(seconds / 0.05)):
        if pred() or proc.poll() is not None:
            return
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_saves_and_the_rerun_continues(tmp_path):
    args = [*TINY, "--training.steps", "400", "--checkpoint.interval", "1000",
            "--job.dump_folder", str(tmp_path)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(REPO / "train.py"), *args]
    jsonl = tmp_path / "metrics.jsonl"

    def logged_steps():
        return len(jsonl.read_text().splitlines()) if jsonl.exists() else 0

    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    _wait_for(lambda: logged_steps() >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, log[-3000:]
    complete = scan_checkpoints(tmp_path / "checkpoint")[0]
    assert len(complete) == 1, log[-3000:]
    (stopped,) = complete
    assert 3 <= stopped < 400 and max(metrics(tmp_path)) == stopped

    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    _wait_for(lambda: logged_steps() > stopped + 1, proc)
    proc.send_signal(signal.SIGUSR1)  # SLURM's warning signal works the same way
    log = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, log[-3000:]
    steps = [r["step"] for r in read_jsonl(jsonl)]
    assert steps[stopped] == stopped + 1  # the rerun continued after the saved step
    assert max(scan_checkpoints(tmp_path / "checkpoint")[0]) > stopped
