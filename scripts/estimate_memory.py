"""Estimate per-GPU peak memory of a training config without a GPU.

    python scripts/estimate_memory.py --job.config_file llama_8b.toml --world_size 8
    python scripts/estimate_memory.py --job.config_file llama_70b.toml --world_size 64 \
        --parallelism.tensor_parallel_degree 8 --training.local_batch_size 16

Every train.py option is accepted (same parser). Extra options, stripped before parsing:
  --world_size N    number of ranks (default 1)
  --vocab_size N    skip building the tokenizer (default: its padded size; Llama 3's 128256 when
                    the configured tokenizer file is missing, e.g. on a laptop)
  --device cpu      no allocator cache (the peak RSS of a CPU run)
On CUDA the estimate is the caching allocator's peak reserved memory, what train.py logs as mem
(`memory_gib`); the CUDA context and NCCL's buffers come on top of it, outside the allocator.
  --measure N       (one process, CPU) also run N real training steps in this process and
                    print the measured peak RSS above the baseline taken after the tokenizer
                    and data loader are built but before the model is, and the peak of the
                    bytes tensors held (torch's MemTracker: what the estimate models, without
                    what the C allocator keeps of freed memory) (validation)
The assumptions are in titanlite/memory_estimate.py's docstring; measured error in
docs/performance.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.checks import check_options  # noqa: E402
from titanlite.config import ConfigError  # noqa: E402
from titanlite.config_parse import exit_on_help, parse_args  # noqa: E402
from titanlite.memory_estimate import GIB, estimate, estimate_stages  # noqa: E402
from titanlite.plan.shape import setup_from_config  # noqa: E402

LLAMA3_VOCAB = 128256
_EXTRA = {"--world_size": int, "--vocab_size": int, "--device": str, "--measure": int}


def split_extra(argv: list[str]) -> tuple[dict, list[str]]:
    """Pull our own options (--name v or --name=v) out of argv; the rest goes to parse_args."""
    extra, rest, i = {}, [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in _EXTRA:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                i += 1
                value = argv[i]
            try:
                extra[name[2:]] = _EXTRA[name](value)
            except ValueError:
                raise ConfigError(
                    f"{name}: expected {_EXTRA[name].__name__}, got {value!r}"
                ) from None
        else:
            rest.append(argv[i])
        i += 1
    return extra, rest


def model_args_of(cfg, vocab_size: int | None):
    """The run's model args, made as training makes them (titanlite.job): from the tokenizer,
    unless --vocab_size names the vocab or the tokenizer is not available (then Llama 3's)."""
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.job import resolve_model

    if vocab_size:
        return resolve_model(cfg, vocab_size).args
    try:
        build_tokenizer(cfg.model)  # here, to tell a missing tokenizer from other mistakes
    except (OSError, ValueError) as e:
        print(f"note: tokenizer not available ({e}); using Llama 3's vocab {LLAMA3_VOCAB}")
        return resolve_model(cfg, LLAMA3_VOCAB).args
    return resolve_model(cfg).args


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    raise OSError(f"{field} not in /proc/self/status")


def measure(cfg, steps: int) -> tuple[float, float]:
    """(peak RSS growth, peak bytes of live tensors) over building the trainer and `steps` steps
    of a world-1 run. The RSS holds model, optimizer and activations, plus the tokenizer's and
    the loader's prefetched batches (a few MB) and what glibc keeps of freed memory; torch's
    MemTracker counts each tensor storage from its allocation to its release."""
    from torch.distributed._tools.mem_tracker import MemTracker

    import train

    cfg.metrics.peak_tflops = cfg.metrics.peak_tflops or 1.0  # no calibration allocations
    cfg.metrics.enable_tensorboard = cfg.metrics.enable_jsonl = False
    dist_env = train.init_distributed()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    baseline = _rss_bytes("VmRSS")
    tracker = MemTracker()
    with tracker:
        trainer = train.Trainer(cfg, dist_env)
        for step in range(steps):
            if step:  # it keeps one iteration's statistics per module, the peak across them
                tracker.reset_mod_stats()
            trainer.train_step()
    trainer.close()
    train.destroy()  # the one-rank process group: left to interpreter exit it can abort
    peaks = tracker.get_tracker_snapshot("peak")
    live = sum(d["Total"] for dev, d in peaks.items() if dev.type != "meta")  # meta: no memory
    return _rss_bytes("VmHWM") - baseline, live


def print_stages(setup):
    """One column per pipeline rank (its stages' blocks, embedding / head); returns the
    estimate of the rank with the highest peak."""
    stages = estimate_stages(setup)
    ranks = range(setup.pp)
    print(f"{'GiB per pipeline rank':<34}" + "".join(f"{'pp ' + str(r):>9}" for r in ranks))
    for row in stages[0].rows:
        print(f"{row:<34}" + "".join(f"{e.rows[row] / GIB:>9.3f}" for e in stages))
    print(
        f"{'total (estimated peak per rank)':<34}"
        + "".join(f"{e.total / GIB:>9.3f}" for e in stages)
    )
    return max(stages, key=lambda e: e.total)


def main(argv: list[str]) -> int:
    exit_on_help(argv, __doc__)
    try:
        extra, rest = split_extra(argv)
        cfg = parse_args(rest)
        check_options(cfg)
        model_args = model_args_of(cfg, extra.get("vocab_size"))
        vocab = model_args.vocab_size
        world = extra.get("world_size", 1)
        setup = setup_from_config(cfg, world, model_args, extra.get("device", "cuda"))
        if extra.get("measure") and (world != 1 or setup.device != "cpu"):
            raise ConfigError("--measure runs one CPU process: use --world_size 1 --device cpu")
    except (ConfigError, ValueError) as e:
        print(f"estimate_memory: error: {e}", file=sys.stderr)
        return 2
    est = estimate(setup)
    s = setup
    print(
        f"{cfg.model.flavor}: {est.num_params / 1e9:.3f} B params, vocab {vocab}; world {world} "
        f"= pp {s.pp} x dp_replicate {s.dp_replicate} x dp_shard {s.dp_shard} x cp {s.cp} x "
        f"tp {s.tp}; local "
        f"batch {s.local_batch_size} x seq {s.seq_len}; AC {s.ac_mode}"
        + (f" ({s.selective_ac_option})" if s.ac_mode == "selective" else "")
        + f"; loss chunk {s.chunk_tokens or 'off'}; {s.param_dtype}; device {s.device}"
    )
    if s.pp > 1:
        est = print_stages(setup)
    else:
        print(est.table())
    print(f"estimated peak per rank: {est.total / GIB:.1f} GiB")
    if s.device == "cuda":
        print(
            "(peak reserved by torch's allocator: compare with train.py's logged mem; the CUDA "
            "context and NCCL's buffers come on top, outside the allocator, not estimated)"
        )
    if extra.get("measure"):
        rss, live = measure(cfg, extra["measure"])
        for what, measured in (("peak RSS above baseline", rss), ("peak of live tensors", live)):
            err = 100 * (est.total - measured) / measured
            print(
                f"measured {what}: {measured / GIB:.3f} GiB; estimate {est.total / GIB:.3f} GiB "
                f"({err:+.1f}%)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
