"""Generate text from a training checkpoint (the counterpart of torchtitan's test_generate.py).

    python scripts/generate.py --config outputs/debug/config.toml \
        --checkpoint outputs/debug/checkpoint/step-100 --prompt "def main(" --max_new_tokens 64
    torchrun --nproc_per_node=2 scripts/generate.py ... [--tp 2]      # tensor parallel

The model is the run's (its config.toml: flavor, tokenizer, training.seq_len as max_seq_len); its
weights are the checkpoint's model part, from a full training checkpoint or a model-only one, read
by DCP into this layout whatever layout saved them. Tensor parallelism spans --tp processes
(default: all of them; with fewer, the world / tp groups each compute the same tokens). Device and
backend are train.py's: CUDA + NCCL where present, else CPU + gloo.

Decoding is titanlite.eval.generate's: --temperature 0 is greedy (argmax, deterministic). Above 0
a token is sampled from softmax(logits / temperature) over the --top_k most likely tokens (0 = all)
and within --top_p, by a generator seeded with --seed: the same seed gives the same tokens, and
every TP rank draws the same ones from the same replicated logits. The padding rows of the
vocabulary (the tokenizer's size rounded up to 128) are never chosen. A response ends at
end-of-text (unless --ignore_eos), at a --stop string, or after --max_new_tokens; prompt + new
tokens may run past the run's training.seq_len (RoPE's table is built for the length asked; a
warning says those positions were never trained on). --prompt may be given several times: the
prompts are generated together as one batch.

Cost: a KV cache, so each new token is one forward of one position per prompt (--no_cache: the
whole sequence again per token, the reference). Only the last position goes through the output
projection, so no step builds a [sequence, vocabulary] logits tensor.

--out prints a JSON report on stdout (rank 0): torchtitan's {"metadata": ..., "responses": [...]}
with the prompt, token ids and decoding settings added. Logs go to stderr. User mistakes (missing
config, missing or partial checkpoint, bad option values, a TP degree that does not divide the world
or the heads) stop with one line and exit status 2 before any weight is read.
"""

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titanlite.checkpoint import (  # noqa: E402
    CheckpointError,
    CheckpointManager,
    LoadPlan,
    check_checkpoint_dir,
)
from titanlite.config import Checkpoint, ConfigError  # noqa: E402
from titanlite.config_parse import parse_args  # noqa: E402
from titanlite.data.tokenizer import Tokenizer  # noqa: E402
from titanlite.distributed import destroy, init_distributed  # noqa: E402
from titanlite.eval.generate import Generation, Sampling, generate  # noqa: E402
from titanlite.job import resolve_model  # noqa: E402
from titanlite.metrics import DeviceMemoryMonitor, init_logger  # noqa: E402
from titanlite.models import ModelFamily, get_family  # noqa: E402
from titanlite.parallel_dims import ParallelDims  # noqa: E402

logger = logging.getLogger("titanlite.generate")


def parse_cli(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--config",
        type=Path,
        required=True,
        help="the run's config.toml (train.py writes it into job.dump_folder)",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="a checkpoint step folder, e.g. outputs/debug/checkpoint/step-100",
    )
    p.add_argument(
        "--prompt", action="append", help="text to continue (BOS is prepended); repeat for a batch"
    )
    p.add_argument("--max_new_tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="0 = greedy (argmax); default 1.0"
    )
    p.add_argument(
        "--top_k", type=int, default=0, help="sample among the K most likely tokens (0 = all)"
    )
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling (1 = all tokens)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at end-of-text")
    p.add_argument("--no_cache", action="store_true", help="no KV cache (the slow reference)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument(
        "--tp",
        type=int,
        default=0,
        help="tensor-parallel degree (default 0: the number of processes)",
    )
    p.add_argument("--out", action="store_true", help="print a JSON report on stdout")
    return p.parse_args(argv)


class Job(NamedTuple):
    tokenizer: Tokenizer
    family: ModelFamily
    model_args: object  # the family's args
    parallel_dims: ParallelDims
    prompt_ids: list[list[int]]


def prepare(opts: argparse.Namespace, world_size: int) -> Job:
    """Every check that needs no weights, cheapest first: each user mistake is one line."""
    check_options(opts)
    if not opts.config.is_file():
        raise FileNotFoundError(
            f"--config {opts.config}: no such file; pass the run's config.toml (train.py writes "
            "it into job.dump_folder)"
        )
    cfg = parse_args(["--job.config_file", str(opts.config.resolve())])
    check_checkpoint_dir(opts.checkpoint, "--checkpoint")
    tokenizer, args = resolve_model(cfg)
    parallel_dims = tp_layout(opts.tp or world_size, world_size, args)
    prompt_ids = [tokenizer.encode(p, bos=True, eos=False) for p in opts.prompt]
    longest = max(len(p) for p in prompt_ids)
    total = longest + opts.max_new_tokens
    if total > args.max_seq_len:
        # Nothing in the weights depends on the length: only the RoPE table does, and it is
        # built for the positions asked.
        logger.warning(
            f"the prompt ({longest} tokens with BOS) + --max_new_tokens "
            f"({opts.max_new_tokens}) = {total} tokens, beyond the run's training.seq_len "
            f"{args.max_seq_len}: positions past it were never trained on"
        )
        args = dataclasses.replace(args, max_seq_len=total)
    return Job(tokenizer, get_family(cfg.model.name), args, parallel_dims, prompt_ids)


def check_options(opts: argparse.Namespace) -> None:
    if opts.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {opts.max_new_tokens}")
    if not opts.temperature >= 0:  # NaN too
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {opts.temperature}")
    if opts.top_k < 0:
        raise ValueError(f"--top_k must be >= 0 (0 = all tokens), got {opts.top_k}")
    if not 0 < opts.top_p <= 1:
        raise ValueError(f"--top_p must be in (0, 1] (1 = all tokens), got {opts.top_p}")
    if opts.tp < 0:
        raise ValueError(f"--tp must be >= 1 (or 0 = the number of processes), got {opts.tp}")


def tp_layout(tp: int, world_size: int, model_args) -> ParallelDims:
    """TP over `tp` ranks; the world / tp groups are replicas that compute the same tokens."""
    if world_size % tp:
        raise ValueError(
            f"--tp {tp} does not divide the number of processes ({world_size}); use a divisor, "
            f"e.g. --tp {world_size}"
        )
    parallel_dims = ParallelDims(dp_replicate=world_size // tp, dp_shard=1, tp=tp,
                                 world_size=world_size)  # fmt: skip
    parallel_dims.validate_model(model_args)  # TP must split the heads and widths evenly
    return parallel_dims


def build_inference_model(job: Job, device: torch.device) -> nn.Module:
    """Meta build -> TP (no FSDP, AC or compile: nothing is trained) -> this rank's shards on the
    device, weights not yet loaded."""
    with torch.device("meta"):
        model = job.family.model_cls(job.model_args)
    if job.parallel_dims.tp_enabled:
        job.parallel_dims.build_mesh(device.type)
        job.family.tensor_parallel(model, job.parallel_dims.tp_mesh, shard_logits=False)
    model.to_empty(device=device).eval()
    model.init_buffers(device)  # the RoPE cache is derived, not saved
    # The loop reads only the last position's logits; registered after TP's own input hook, so
    # under TP it slices the gathered (replicated) sequence.
    model.output.register_forward_pre_hook(lambda _, args: (args[0][:, -1:],))
    return model


def load_weights(model: nn.Module, step_dir: Path) -> None:
    """The model part of a full or model-only checkpoint, resharded into this layout."""
    manager = CheckpointManager(
        Checkpoint(), step_dir.parent, model, None, None, None, None, n_layers=model.args.n_layers
    )
    try:
        manager.load(LoadPlan(step_dir, weights_only=True))
    finally:
        manager.close()


def sampling_of(opts) -> Sampling:
    return Sampling(
        max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
        top_p=opts.top_p, stop=tuple(opts.stop), stop_at_eos=not opts.ignore_eos, seed=opts.seed,
    )  # fmt: skip


def report(opts, job: Job, out: Generation, seconds: float, memory, world_size: int) -> dict:
    """torchtitan's report, one response per prompt, plus the prompts, token ids and decoding
    settings."""
    stats = memory.get_peak_stats()
    generated = sum(len(ids) for ids in out.ids)
    metadata = {
        "generated_n_tokens": generated,
        "input_n_tokens": sum(len(p) for p in job.prompt_ids),
        "generation_time_sec": seconds,
        "tokens_per_sec": generated / seconds,  # generated tokens only
        "batch_size": len(job.prompt_ids),
        "seed": opts.seed,
        "temperature": opts.temperature,
        "top_k": opts.top_k,
        "top_p": opts.top_p,
        "stop": opts.stop,
        "kv_cache": not opts.no_cache,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()),
        "memory/max_active(GiB)": stats.max_active_gib,
        "memory/max_active(%)": stats.max_active_pct,
        "memory/max_reserved(GiB)": stats.max_reserved_gib,
        "memory/max_reserved(%)": stats.max_reserved_pct,
        "memory/num_alloc_retries": stats.num_alloc_retries,
        "memory/num_ooms": stats.num_ooms,
        "world_size": world_size,
        "tp": job.parallel_dims.tp,
        "torch_version": torch.__version__,
        "checkpoint": str(opts.checkpoint),
    }
    responses = [
        {
            "response_idx": i,
            "prompt": prompt,
            "input_text": job.tokenizer.decode(ids),
            "output_text": text,
            "input_ids": ids,
            "output_ids": new_ids,
        }
        for i, (prompt, ids, new_ids, text) in enumerate(
            zip(opts.prompt, job.prompt_ids, out.ids, out.texts, strict=True)
        )
    ]
    return {"metadata": metadata, "responses": responses}


def main(argv: list[str] | None = None) -> int:
    opts = parse_cli(argv)
    opts.prompt = opts.prompt or [""]
    rank, _, world_size, device = init_distributed()
    init_logger(rank, stream=sys.stderr)
    try:
        job = prepare(opts, world_size)
        model = build_inference_model(job, device)
        load_weights(model, opts.checkpoint)
    except (ConfigError, ValueError, FileNotFoundError, CheckpointError) as e:
        if rank == 0:  # every rank fails alike
            print(f"generate: error: {e}", file=sys.stderr)
        destroy(barrier=False)
        return 2
    memory = DeviceMemoryMonitor(device)  # peak from here: the weights plus generation
    t0 = time.perf_counter()
    out = generate(model, job.tokenizer, job.prompt_ids, sampling_of(opts), cache=not opts.no_cache)
    seconds = time.perf_counter() - t0
    generated = sum(len(ids) for ids in out.ids)
    logger.info("generated %d tokens in %.2f s (%.1f tokens/s)",
                generated, seconds, generated / seconds)  # fmt: skip
    if rank == 0:
        result = report(opts, job, out, seconds, memory, world_size)
        texts = [p + t for p, t in zip(opts.prompt, out.texts, strict=True)]
        print(json.dumps(result, indent=4) if opts.out else "\n\n".join(texts))
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
