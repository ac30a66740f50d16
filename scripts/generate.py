"""Generate text from a training checkpoint (the counterpart of torchtitan's test_generate.py).

    python scripts/generate.py --config outputs/debug/config.toml \
        --checkpoint outputs/debug/checkpoint/step-100 --prompt "def main(" --max_new_tokens 64
    torchrun --nproc_per_node=2 scripts/generate.py ... [--tp 2]      # tensor parallel

The model is the run's (its config.toml: flavor, tokenizer, training.seq_len as max_seq_len); its
weights are the checkpoint's model part, from a full training checkpoint or a model-only one, read
by DCP into this layout whatever layout saved them. Tensor parallelism spans --tp processes
(default: all of them; with fewer, the world / tp groups each compute the same tokens). Device and
backend are train.py's: CUDA + NCCL where present, else CPU + gloo.

Decoding: --temperature 0 is greedy (argmax, deterministic). Above 0 a token is sampled from
softmax(logits / temperature) over the --top_k most likely tokens (0 = all), by a generator seeded
with --seed: the same seed gives the same tokens, and every TP rank draws the same ones from the
same replicated logits. The padding rows of the vocabulary (the tokenizer's size rounded up to 128)
are never chosen. Exactly --max_new_tokens are generated (no stop at end-of-text), and prompt + new
tokens may run past the run's training.seq_len (RoPE's table is built for the length asked; a
warning says those positions were never trained on).

Cost: there is no KV cache. Each new token re-runs the forward over the whole sequence so far, so
n tokens cost O(n^2) token-forwards (attention O(n^3)): fine for checking a trained model, slow for
long outputs. Only the last position goes through the output projection, so no step builds a
[sequence, vocabulary] logits tensor.

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
    p.add_argument("--prompt", default="", help="text to continue (BOS is prepended)")
    p.add_argument("--max_new_tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="0 = greedy (argmax); default 1.0"
    )
    p.add_argument(
        "--top_k", type=int, default=0, help="sample among the K most likely tokens (0 = all)"
    )
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
    prompt_ids: list[int]


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
    prompt_ids = tokenizer.encode(opts.prompt, bos=True, eos=False)
    total = len(prompt_ids) + opts.max_new_tokens
    if total > args.max_seq_len:
        # Nothing in the weights depends on the length: only the RoPE table does, and it is
        # built for the positions asked.
        logger.warning(
            f"the prompt ({len(prompt_ids)} tokens with BOS) + --max_new_tokens "
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


def next_token(logits, temperature: float, top_k: int, n_words: int, generator) -> torch.Tensor:
    """logits [b, vocab] -> token ids [b]; the vocabulary's padding ids are never chosen."""
    logits = logits[:, :n_words].float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, n_words), dim=-1).values[:, -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_new_tokens: int, **sampling) -> list[int]:
    """Append max_new_tokens to the prompt, one full forward per token (see the docstring)."""
    n = len(prompt_ids)
    device = model.rope_cache.device
    tokens = torch.empty(1, n + max_new_tokens, dtype=torch.long, device=device)
    tokens[0, :n] = torch.tensor(prompt_ids)
    for pos in range(n, n + max_new_tokens):
        logits = model(tokens[:, :pos])  # [1, 1, vocab]: the last position only
        tokens[:, pos] = next_token(logits[:, -1], **sampling)
    return tokens[0, n:].tolist()


def report(opts, job: Job, new_ids: list[int], seconds: float, memory, world_size: int) -> dict:
    """torchtitan's report for one response, plus the prompt, token ids and decoding settings."""
    stats = memory.get_peak_stats()
    metadata = {
        "generated_n_tokens": len(new_ids),
        "input_n_tokens": len(job.prompt_ids),
        "generation_time_sec": seconds,
        "tokens_per_sec": len(new_ids) / seconds,  # generated tokens only
        "batch_size": 1,
        "seed": opts.seed,
        "temperature": opts.temperature,
        "top_k": opts.top_k,
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
    response = {
        "response_idx": 0,
        "prompt": opts.prompt,
        "input_text": job.tokenizer.decode(job.prompt_ids),
        "output_text": job.tokenizer.decode(new_ids),
        "input_ids": job.prompt_ids,
        "output_ids": new_ids,
    }
    return {"metadata": metadata, "responses": [response]}


def main(argv: list[str] | None = None) -> int:
    opts = parse_cli(argv)
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
    generator = torch.Generator(device).manual_seed(opts.seed)
    t0 = time.perf_counter()
    new_ids = generate(
        model, job.prompt_ids, opts.max_new_tokens, temperature=opts.temperature,
        top_k=opts.top_k, n_words=job.tokenizer.n_words, generator=generator,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    logger.info("generated %d tokens in %.2f s (%.1f tokens/s)",
                len(new_ids), seconds, len(new_ids) / seconds)  # fmt: skip
    if rank == 0:
        result = report(opts, job, new_ids, seconds, memory, world_size)
        text = opts.prompt + result["responses"][0]["output_text"]
        print(json.dumps(result, indent=4) if opts.out else text)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
