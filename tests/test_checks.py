"""titanlite/checks.py: the checks across options (run by train.py once parsed, and with the world
size by resolve_job), each one ConfigError naming the fix; ParallelDims built from the config."""

import sys

import pytest
import torch
from conftest import config_error

from titanlite.checks import check_offload_device
from titanlite.config import ConfigError, Parallelism, Training
from titanlite.config_parse import parse_args
from titanlite.job import World, resolve_global_batch, resolve_job
from titanlite.parallel_dims import ParallelDims


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--checkpoint.load_step", "3"], "needs --checkpoint.enable"),
        (["--lr_scheduler.decay_ratio", "1.5"], "decay_ratio must be in [0, 1], or -1"),
        (["--optimizer.name", "SGD"], "AdamW"),
        (
            ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
             "--checkpoint.initial_load_path", "x"],
            "cannot be combined",
        ),
        (
            ["--activation_checkpoint.mode", "selective",
             "--activation_checkpoint.selective_ac_option", "0"],
            "'op', 'op_alternate' or a positive integer",
        ),
        (["--training.dataset_streaming"], "set training.dataset_path"),
        (["--training.dataset_max_bad_rows", "5"], "skips bad rows of local files: set"),
        (
            ["--training.dataset", "c4", "--training.dataset_max_bad_rows", "5"],
            "hub datasets and python_stdlib are read as they come",
        ),
        (
            ["--training.dataset_streaming", "--training.dataset_path", "x.jsonl",
             "--validation.enable"],
            "needs validation.dataset_path",
        ),
        (
            ["--optimizer.early_step_in_backward", "--training.max_norm", "0",
             "--metrics.log_layer_grad_norms"],
            "--optimizer.early_step_in_backward frees each one as soon as it is stepped",
        ),
    ],
)  # fmt: skip
def test_options_that_contradict_each_other(argv, expected):
    assert expected in config_error(argv)


def test_wandb_without_the_package_is_one_line_before_anything_is_built(monkeypatch, capsys):
    import train

    monkeypatch.setitem(sys.modules, "wandb", None)  # how import sees a package not installed
    message = "metrics.enable_wandb needs the wandb package: pip install wandb"
    assert message in config_error(["--metrics.enable_wandb"])
    assert train.main(["--metrics.enable_wandb"]) == 2  # parse time: no process group, no model
    assert capsys.readouterr().err.startswith(f"titanlite: error: {message}")
    parse_args(["--no-metrics.enable_wandb"])  # off, the package is not needed


def test_the_error_line_is_one_write_so_ranks_sharing_a_pipe_do_not_run_together(monkeypatch):
    """Under torchrun all ranks write to one stderr pipe, unbuffered: a line written in two
    parts (text, then newline) let two ranks' lines join into one in CI."""
    import train

    writes = []
    monkeypatch.setattr(sys, "stderr", type("Pipe", (), {"write": lambda _, s: writes.append(s)})())
    assert train.main(["--training.stepz", "3"]) == 2
    assert len(writes) == 1 and writes[0].startswith("titanlite: error: "), writes
    assert writes[0].endswith("\n") and writes[0].count("\n") == 1, writes


@pytest.mark.parametrize(
    "local, global_, dp, expected",
    [(4, -1, 2, (8, 1)), (2, 16, 2, (16, 4)), (8, 8, 1, (8, 1))],
)
def test_global_batch_resolves_to_whole_microbatches(local, global_, dp, expected):
    training = Training(local_batch_size=local, global_batch_size=global_)
    assert resolve_global_batch(training, dp) == expected


@pytest.mark.parametrize("global_", [6, 0, -2])
def test_global_batch_that_does_not_split_names_the_fix(global_):
    training = Training(local_batch_size=2, global_batch_size=global_)
    with pytest.raises(ConfigError, match=r"local_batch_size \(2\) x data-parallel degree \(2\)"):
        resolve_global_batch(training, 2)


def test_parallel_dims_from_the_config_sections_degrees():
    p = Parallelism(data_parallel_replicate_degree=2, tensor_parallel_degree=2)
    p.pipeline_parallel_degree = 2
    pd = ParallelDims.from_config(p, world_size=16)
    assert (pd.pp, pd.dp_replicate, pd.dp_shard, pd.cp, pd.tp) == (2, 2, 2, 1, 2)


def test_resolve_job_resolves_the_layout_and_refuses_a_world_it_does_not_fit():
    cfg = parse_args(["--job.config_file", "debug_model.toml", "--model.vocab_limit", "512"])
    cfg.training.local_batch_size, cfg.training.global_batch_size = 2, 8
    job = resolve_job(cfg, World(2))
    assert (job.parallel_dims.dp_shard, job.global_batch_size, job.num_microbatches) == (2, 8, 2)
    assert job.model_args.vocab_size == 640 and job.pipeline is None  # 512 + specials, padded
    cfg.parallelism.tensor_parallel_degree = 3
    with pytest.raises(ConfigError, match="world size 2"):
        resolve_job(cfg, World(2))


CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize(
    "argv, device, version, expected",
    [
        (["--optimizer.early_step_in_backward"], CUDA, "2.11.0+cu130", "fixed in 2.12"),
        (["--optimizer.early_step_in_backward"], CUDA, "2.12.0", None),
        (["--optimizer.early_step_in_backward"], CPU, "2.11.0", None),  # nothing pinned on CPU
        (["--parallelism.data_parallel_replicate_degree", "2"], CUDA, "2.13.0", "HSDP"),
        (["--parallelism.data_parallel_replicate_degree", "2"], CPU, "2.13.0", None),
        ([], CUDA, "2.11.0", None),
    ],
)  # fmt: skip
def test_cpu_offload_races_are_refused_on_cuda(argv, device, version, expected):
    base = ["--training.enable_cpu_offload", "--training.max_norm", "0"]
    cfg = parse_args(base + argv)
    pd = ParallelDims.from_config(cfg.parallelism, world_size=4)
    if expected is None:
        check_offload_device(cfg, pd, device, version)
        return
    with pytest.raises(ConfigError, match=expected) as info:
        check_offload_device(cfg, pd, device, version)
    assert "\n" not in str(info.value)


def test_no_offload_no_offload_check():
    """HSDP on CUDA is refused only with CPU offload: the same layout without it passes."""
    hsdp = ["--parallelism.data_parallel_replicate_degree", "2"]
    offload = ["--training.enable_cpu_offload", "--training.max_norm", "0"]
    cfg, offloaded = parse_args(hsdp), parse_args(hsdp + offload)
    pd = ParallelDims.from_config(cfg.parallelism, 4)
    assert check_offload_device(cfg, pd, CUDA, "2.11.0") is None
    with pytest.raises(ConfigError, match="HSDP"):
        check_offload_device(offloaded, pd, CUDA, "2.11.0")


@pytest.mark.parametrize("argv, expected", [
    (["--checkpoint.initial_load_in_hf"], "needs --checkpoint.initial_load_path"),
    (["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", "x",
      "--no-checkpoint.initial_load_model_only"], "needs checkpoint.initial_load_model_only"),
    (["--checkpoint.last_save_in_hf", "--checkpoint.enable"],
     "add --checkpoint.last_save_model_only"),
    (["--checkpoint.last_save_model_only"], "shapes the last checkpoint: add --checkpoint.enable"),
])  # fmt: skip
def test_a_checkpoint_option_without_the_one_it_needs_is_one_line(argv, expected):
    assert expected in config_error(argv)
