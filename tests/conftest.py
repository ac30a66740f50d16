"""Shared test helpers: an isolated, offline environment and a launcher for real training runs."""

# ruff: noqa: E402 (the environment below must be set before torch is imported)
import os

# Two pytest workers on 2 cores, and the ranks they start, run more threads than there are cores.
# libgomp's default active wait has each idle OpenMP thread spin at every barrier, burning a core
# another process needs; passive waiting cut the non-slow tests from 214-217 to 189-203 CPU-s.
# libgomp reads this once, when `import torch` loads it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import io
import json
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ranks import run_ranks
from wandb_offline import wandb_offline_env

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train.py"


@pytest.fixture(scope="session", autouse=True)
def offline_env(tmp_path_factory):
    """No network, and one token cache shared by the whole session (tokenizing is the slow part)."""
    cache = tmp_path_factory.mktemp("titanlite_cache")
    hf = tmp_path_factory.mktemp("hf_home")
    saved = dict(os.environ)
    os.environ.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(hf),
        TITANLITE_CACHE=str(cache),
        TOKENIZERS_PARALLELISM="false",
    )
    yield
    os.environ.clear()
    os.environ.update(saved)


# The debug model shrunk for seconds-long train.py runs: a global batch of 8 x 32 tokens, fp32,
# a metrics line every step, 4 of its 6 blocks. Each block is its own FSDP unit with TP and CP
# collectives of its own, so among 4 ranks on 2 cores the blocks are most of a step's time (6 ->
# 4 took test_resume.py and test_parallel_numerics.py from 576 to 426-440 CPU-s); 4 still fill
# a pipeline of 4 stages.
# Pipeline parity keeps all 6 (test_pipeline_numerics.py): splits of uneven stages.
TINY_FLAVOR = "debugmodel_4L"
TINY_TRAIN = [
    "--job.config_file", "debug_model.toml",
    "--model.flavor", TINY_FLAVOR,
    "--model.vocab_limit", "512",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--training.global_batch_size", "8",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--no-metrics.enable_tensorboard",
    "--metrics.peak_tflops", "1",  # skips the CPU matmul calibration at start-up
]  # fmt: skip


def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto`: one per core, at most 4. Most slow tests launch 2-4 processes of
    their own, so more workers would only queue on the same cores (and hold their memory); two
    workers on two cores fill the gaps where one file waits on process start-up or a timer."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_collection_modifyitems(items):
    """Files with slow tests first, each file kept whole: with the suite spread over processes
    (pytest-xdist, one file per worker at a time) the long launches start early and the quick
    in-process files fill the gaps at the end instead of one long file running alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(autouse=True)
def no_process_group_left():
    """Each in-process test starts without a default process group: a world-1 Trainer or
    train.main that returned early on a user error leaves its one-rank group behind (a real run's
    process exits), and the next test may need a different one (the dry run's fake group)."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_train(args, nproc=1, env=None, timeout=600, check=True, nnodes_args=None):
    """Run train.py as a user would: plain python for one process, torchrun (gloo) for more.

    With check=True a non-zero exit fails the test and shows the output.
    """
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    if nproc == 1 and nnodes_args is None:
        cmd = [sys.executable, str(TRAIN), *args]
    else:
        launch = nnodes_args or ["--standalone"]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", *launch,
            f"--nproc_per_node={nproc}", str(TRAIN), *args,
        ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def torchrun_script(script, *args, nproc=4, timeout=600, check=True):
    """Run a worker script on `nproc` gloo ranks (1 thread each; plain python for one rank), each
    a fork of a process that has imported torch and titanlite (tests/support/ranks.py); with
    `check` a non-zero exit fails the test."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_ranks(script, args, nproc, env, timeout, free_port)
    if check and proc.returncode != 0:
        pytest.fail(f"{script} on {nproc} ranks exited {proc.returncode}\n{proc.stderr[-6000:]}")
    return proc


def train_many(jobs: list, nproc: int, timeout=900):
    """Several train.py jobs (argument lists; or {"copy": [src, dst]} between them) one after
    another in one process, or one torchrun launch of `nproc` ranks (tests/integration/
    train_many.py)."""
    script = REPO / "tests" / "integration" / "train_many.py"
    return torchrun_script(script, json.dumps(jobs), nproc=nproc, timeout=timeout)


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous or a daemon to bind, taken below the
    kernel's ephemeral range: the bind may come many seconds later (a requeued SLURM job), and by
    then a port of that range may have gone to any process's outgoing connection or gloo
    listener, and a rendezvous that cannot bind its port connects to whoever holds it."""
    port_range = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux; 32768 is its default
    ephemeral_low = int(port_range.read_text().split()[0]) if port_range.exists() else 32768
    rng = random.SystemRandom()  # not the tests' seeded `random`
    for _ in range(1000):
        port = rng.randrange(10_000, ephemeral_low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in 10000-{ephemeral_low}")


def read_jsonl(path):
    """The metrics a run wrote, one dict per logged step."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """The real wandb (the dev extra installs it), offline; its service process stops after."""
    wandb = pytest.importorskip("wandb")
    wandb_offline_env(monkeypatch, tmp_path / "wandb_home")
    yield wandb
    wandb.teardown()


@pytest.fixture
def train_runner():
    return run_train


def assert_nested_equal(a, b, path=""):
    """Exact equality of nested state (dicts, lists, tensors with dtype, arrays, scalars)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_nested_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_nested_equal(x, y, f"{path}.{i}")
    else:
        assert a == b, path


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every F.scaled_dot_product_attention call made during the test, as (q, k, kwargs): the
    attention code looks the function up on torch.nn.functional at each call."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        calls.append((q, k, kwargs))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


def write_torch_schedule(path, name: str, pp: int, num_stages: int, microbatches: int):
    """Write the compute order torch's named multi-stage schedule `name` gives `pp` ranks to
    `path` as a schedule CSV (a row per rank, an empty cell per idle slot); returns the path.
    Only the order is wanted, so the schedule is built on stand-in stages: it reads their sizes
    and indices, nothing else."""
    import csv
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import get_schedule_class

    stages = [SimpleNamespace(num_stages=num_stages, group_size=pp, group_rank=0, stage_index=i)
              for i in range(0, num_stages, pp)]  # fmt: skip
    order = get_schedule_class(name)(stages, microbatches).pipeline_order
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([a or "" for a in order[rank]] for rank in range(pp))
    return path


class Terminal(io.StringIO):
    """A stream that says it is a terminal: where titanlite/progress.py prints its lines."""

    def isatty(self):
        return True


def config_error(argv) -> str:
    """The ConfigError that parsing argv and checking its options raise (train.py's first
    steps), as text."""
    from titanlite.checks import check_options
    from titanlite.config import ConfigError
    from titanlite.config_parse import parse_args

    with pytest.raises(ConfigError) as info:
        check_options(parse_args(argv))
    return str(info.value)


def load_dcp_model(model, step_dir: Path):
    """`model` (one plain process) with the weights of the DCP checkpoint `step_dir`."""
    import torch.distributed.checkpoint as dcp

    from titanlite.checkpoint.stream import single_process_quietly

    weights = model.state_dict()
    with single_process_quietly():
        dcp.load({"model": weights}, checkpoint_id=str(step_dir), no_dist=True)
    model.load_state_dict(weights)
    return model
