"""train.py's step, in process: its pieces are plain functions, and the hot path syncs the host
with the device once per step (reading "finite?" and "stop?" together)."""

import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import REPO, read_jsonl
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.overrides import TorchFunctionMode

import train
from titanlite import checks
from titanlite.checkpoint.staging import ReusingStager
from titanlite.config_parse import parse_args
from titanlite.distributed import init_distributed

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__}
_READS |= {torch.Tensor.__float__, torch.Tensor.__index__}


class HostSyncs(TorchFunctionMode):
    """Records every read of a tensor value by the host (each one waits for the device on a GPU)
    and every transfer titanlite asks for without non_blocking (from pageable memory it would
    wait for the device too). On this CPU-only machine source and target are both the CPU, so
    transfers are judged by the call, made from titanlite's own code, not by what it costs."""

    def __init__(self):
        super().__init__()
        self.reads, self.blocking_copies = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            self.reads.append(args[0])
        moves = func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_)
        if moves and not kwargs.get("non_blocking") and _names_a_device(args[1:], kwargs):
            caller = Path(sys._getframe(1).f_code.co_filename).resolve()
            if caller.is_relative_to(REPO) and "site-packages" not in caller.parts:
                self.blocking_copies.append(f"{caller.name}:{sys._getframe(1).f_lineno}")
        return func(*args, **kwargs)


def _names_a_device(args, kwargs) -> bool:
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)


@pytest.fixture
def trainer(tmp_path, request):
    chunk = request.param
    argv = ["--job.config_file", "debug_model.toml", "--model.vocab_limit", "512"]
    argv += ["--training.seq_len", "32", "--training.local_batch_size", "2"]
    argv += ["--training.global_batch_size", "4", "--training.mixed_precision_param", "float32"]
    argv += ["--loss.chunk_tokens", str(chunk), "--metrics.peak_tflops", "1"]
    argv += ["--no-metrics.enable_tensorboard", "--job.dump_folder", str(tmp_path)]
    argv += ["--training.loss_spike_factor", "3"] if chunk else []  # reads the loss in that sync
    t = train.Trainer(parse_args(argv), init_distributed())
    yield t
    t.close()


@pytest.mark.parametrize(
    "trainer", [0, 16], indirect=True, ids=["plain-loss", "chunked-loss-and-spike-guard"]
)
def test_one_host_sync_per_step(trainer):
    assert trainer.loader.num_microbatches == 2  # accumulation is part of what is checked
    for _ in range(2):  # the first step creates the optimizer state; both must be clean
        with HostSyncs() as syncs:
            out = trainer.train_step()
        # AdamW keeps its step counters on the host (unless capturable): reading them is free.
        counters = [s["step"] for s in trainer.optimizer.state.values()]
        device_reads = [t for t in syncs.reads if not any(t is c for c in counters)]
        assert len(device_reads) == 1, f"{len(device_reads)} host syncs in one step"
        assert syncs.blocking_copies == []
        assert not out.stop and torch.isfinite(out.grad_norm)


def test_every_due_at_its_frequency_and_the_last_step():
    every = train.Every(25, last=90, first=True)
    assert [s for s in range(1, 91) if every.due(s)] == [1, 25, 50, 75, 90]
    assert not any(train.Every(10, 90, enabled=False).due(s) for s in range(1, 91))


def test_step_tokens_count_each_label_once_and_carry_the_stop_vote():
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    microbatches = [(labels, labels), (labels[:1], labels[:1])]
    tokens, votes, none = train.count_step_tokens(microbatches, True, True, torch.device("cpu"))
    assert (tokens.item(), votes.item(), none) == (5, 1, None)
    tokens, votes, _ = train.count_step_tokens(microbatches, False, False, torch.device("cpu"))
    assert (tokens.item(), votes.item()) == (0, 0)  # a TP peer: its labels are counted elsewhere
    # A mixture's tokens per source (this rank's) ride in the same all-reduce; a TP peer's are 0.
    mine = torch.tensor([2, 0, 3])
    *_, by_source = train.count_step_tokens(microbatches, True, False, torch.device("cpu"), mine)
    assert by_source.tolist() == [2, 0, 3]
    *_, by_source = train.count_step_tokens(microbatches, False, False, torch.device("cpu"), mine)
    assert by_source.tolist() == [0, 0, 0]


def test_an_internal_error_keeps_its_traceback(tmp_path, monkeypatch):
    """Only user mistakes (ConfigError) become one line and exit 2: a bug's ValueError
    propagates."""

    def bug(*_):
        raise ValueError("a bug, not the user's")

    monkeypatch.setattr(checks, "check_attention_device", bug)
    argv = ["--job.config_file", "debug_model.toml", "--model.vocab_limit", "512"]
    with pytest.raises(ValueError, match="a bug"):
        train.main([*argv, "--training.seq_len", "32", "--job.dump_folder", str(tmp_path)])


@pytest.mark.parametrize("user", [None, "max_split_size_mb:64"])
def test_main_sets_expandable_segments_before_cuda_starts_unless_the_user_did(user, monkeypatch):
    """Plain torchrun gets the allocator setting too, by the time init_distributed picks the
    device; a user's own setting is kept."""
    seen = {}

    class Started(Exception):
        pass

    def init_distributed(*_, **__):
        seen.update(os.environ)
        raise Started

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # recorded as unset, so teardown removes what main sets
        monkeypatch.delenv(name)
    if user:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(train, "init_distributed", init_distributed)
    with pytest.raises(Started):
        train.main(["--model.vocab_limit", "512"])
    assert seen.get("PYTORCH_CUDA_ALLOC_CONF") == (user or "expandable_segments:True")


def test_block_grad_norms_are_the_grads_norms_and_make_up_the_global_norm(tmp_path, monkeypatch):
    """metrics.log_layer_grad_norms in one process: each block's norm is that of its parameters'
    gradients, measured on log steps only (and without a host sync), and the logged grad_norm
    is the root of the sum of their squares."""
    argv = ["--job.config_file", "debug_model.toml", "--model.vocab_limit", "512"]
    argv += ["--training.seq_len", "32", "--training.local_batch_size", "2"]
    argv += ["--training.mixed_precision_param", "float32", "--metrics.peak_tflops", "1"]
    argv += ["--training.steps", "4", "--metrics.log_freq", "3", "--training.max_norm", "0"]
    argv += ["--metrics.log_layer_grad_norms", "--no-metrics.enable_tensorboard"]
    t = train.Trainer(parse_args([*argv, "--job.dump_folder", str(tmp_path)]), init_distributed())
    try:
        names = t.block_names
        assert names == ["tok_embeddings", *(f"layers.{i}" for i in range(6)), "output"]
        monkeypatch.setattr(t.optimizer, "zero_grad", lambda set_to_none=True: None)
        with HostSyncs() as syncs:
            out = t.train_step(log=True)
        counters = [s["step"] for s in t.optimizer.state.values()]  # on the host: free
        device_reads = [r for r in syncs.reads if not any(r is c for c in counters)]
        assert len(device_reads) == 1  # "finite?" and "stop?": the norms are read at log time
        expected = dict.fromkeys(names, 0.0)
        for name, p in t.model.named_parameters():
            parts = name.split(".")  # plain names here: no wrapper, one process
            block = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
            block = block if block in expected else "output"  # norm joins the output head
            expected[block] += p.grad.double().square().sum().item()
        expected = torch.tensor([expected[n] for n in names], dtype=torch.float64).sqrt()
        torch.testing.assert_close(out.block_norms.double(), expected, rtol=1e-6, atol=0)
        monkeypatch.undo()
        t.optimizer.zero_grad()

        calls = []
        square_sums = train.grad_square_sums
        monkeypatch.setattr(
            train, "grad_square_sums", lambda g, pp: calls.append(len(g)) or square_sums(g, pp)
        )
        t.train()
    finally:
        t.close()
    assert calls == [8, 1, 8, 8]  # logged: step 1, every 3rd, the last; step 2 sums one group
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 3, 4]
    for r in records:
        blocks = torch.tensor([r[f"grad_norm/{n}"] for n in names], dtype=torch.float64)
        assert blocks.square().sum().sqrt().item() == pytest.approx(r["grad_norm"], rel=1e-6)


@pytest.mark.parametrize("early", [False, True], ids=["step-after-backward", "step-in-backward"])
def test_async_save_is_copied_before_the_next_step_changes_the_weights(
    tmp_path, monkeypatch, early
):
    """An async save's copy of the state overlaps the next step's forward and backward; the
    trainer waits for it before the weights change (the optimizer step, or with
    early_step_in_backward the backward). Here each copy is held until the trainer waits for it
    or the weights changed: without that wait it would hold the next step's weights."""
    argv = ["--job.config_file", "debug_model.toml", "--model.vocab_limit", "512"]
    argv += ["--training.seq_len", "32", "--training.local_batch_size", "2"]
    argv += ["--training.mixed_precision_param", "float32", "--metrics.peak_tflops", "1"]
    argv += ["--training.steps", "3", "--no-metrics.enable_tensorboard", "--checkpoint.enable"]
    argv += ["--checkpoint.async_mode", "async", "--checkpoint.interval", "2"]
    argv += ["--optimizer.early_step_in_backward", "--training.max_norm", "0"] if early else []
    released, staged, at_save = threading.Event(), [], []
    copy = StateDictStager.stage

    def held_copy(self, state_dict, **kwargs):
        assert released.wait(120)
        out = copy(self, state_dict, **kwargs)
        staged.append({k: v.clone() for k, v in out["model"].items()})  # the buffers are reused
        return out

    queue = ReusingStager.stage

    def queue_held_copy(self, state_dict):
        released.clear()
        return queue(self, state_dict)

    monkeypatch.setattr(StateDictStager, "stage", held_copy)
    monkeypatch.setattr(ReusingStager, "stage", queue_held_copy)
    t = train.Trainer(parse_args([*argv, "--job.dump_folder", str(tmp_path)]), init_distributed())
    try:
        save, wait = t.checkpointer.save, t.checkpointer.wait_for_staging

        def save_and_remember(step):
            at_save.append({k: v.detach().clone() for k, v in t.model.state_dict().items()})
            save(step)

        def release_then_wait():
            released.set()
            wait()

        target = (t, "forward_backward") if early else (t.optimizer, "step")
        change = getattr(*target)

        def change_then_release(*args, **kwargs):
            out = change(*args, **kwargs)
            released.set()
            return out

        monkeypatch.setattr(t.checkpointer, "save", save_and_remember)
        monkeypatch.setattr(t.checkpointer, "wait_for_staging", release_then_wait)
        monkeypatch.setattr(*target, change_then_release)
        t.train()
        final = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    finally:
        t.close()
    assert len(staged) == len(at_save) == 2  # steps 2 and 3
    for copied, then in zip(staged, at_save):
        assert copied.keys() == then.keys()
        assert all(torch.equal(copied[k], then[k]) for k in then)
    assert not all(torch.equal(final[k], at_save[0][k]) for k in final)  # step 3 did change them
