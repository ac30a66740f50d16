"""Tokenize a corpus into a token store ahead of training, with a pool of worker processes.

    python scripts/prepare_data.py --workers 16 --out /data/c4_llama3 \\
        --training.dataset c4 --model.tokenizer_path tokenizer.model
    python train.py --job.config_file llama_8b.toml --training.dataset_path /data/c4_llama3 \\
        --model.tokenizer_path tokenizer.model

Takes train.py's options (only model.* tokenizer fields, training.dataset* (with
training.dataset_max_bad_rows bad rows are skipped, their count kept in the store's manifest),
training.data_cache_dir and validation.dataset_path matter) plus:
  --workers W   tokenizing processes (default: the CPU count); the store is the same for any W
  --out DIR     where to write the store; train with --training.dataset_path DIR. Without it the
                store goes to the token cache, where train.py with the same options finds it
                (hub datasets are then left to be streamed at training time).

  --shard i/n   tokenize only this machine's share of the store's shards (e.g. a SLURM array
                task: --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT), beside --out on
                storage every machine shares; then run the same command without --shard once:
                it finds every shard done and publishes a store byte-identical to one machine's

A killed run keeps its finished shards: rerun the same command to finish the rest.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from titanlite.config import ConfigError, Training  # noqa: E402
from titanlite.data.cache import cache_dir  # noqa: E402
from titanlite.data.prepared import is_prepared  # noqa: E402
from titanlite.data.sources import (  # noqa: E402
    HUB_DATASETS,
    build_source,
    expand_paths,
    format_runs,
    local_source,
    open_local,
    stdlib_files,
)
from titanlite.data.store import MANIFEST, TokenStore  # noqa: E402
from titanlite.data.store_build import build_store  # noqa: E402
from titanlite.progress import Progress  # noqa: E402


def expected_documents(t: Training) -> int | None:
    """The source's row count where it is known without tokenizing, for the time left (an upper
    bound: empty texts are skipped); None for a hub stream, or for files read row by row
    (training.dataset_max_bad_rows), which would be read twice."""
    if t.dataset_path:
        runs = format_runs(expand_paths(t.dataset_path))
        if t.dataset_max_bad_rows and any(b != "text" for b, _ in runs):
            return None
        # Text files hold one document each; the others: the same map-style load the source
        # itself reads (Arrow cache reused).
        return sum(
            len(fs) if b == "text" else len(open_local(fs, b, t.dataset_text_column))
            for b, fs in runs
        )
    if t.dataset in HUB_DATASETS:  # and no dataset_path, which would win over it
        return None
    return len(stdlib_files()[1])


def _check_existing(out: Path, source, tokenizer) -> bool:
    """True if `out` already holds this store; raises if it holds another one."""
    if not (out / MANIFEST).exists():
        return False
    meta = TokenStore(out).meta
    if (meta["source_fingerprint"], meta["tokenizer"]) != (source.fingerprint, tokenizer.identity):
        raise SystemExit(
            f"{out} already holds a store of {meta['source']} tokenized with {meta['tokenizer']}, "
            f"not {source.name} with {tokenizer.identity}: remove it or choose another --out"
        )
    return True


def parse_shard(text: str) -> tuple[int, int] | None:
    """--shard i/n (0 <= i < n) -> (i, n); '' -> None."""
    if not text:
        return None
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise SystemExit(f"--shard expects i/n with 0 <= i < n (e.g. 0/4), got {text!r}")
    return int(i), int(n)


def prepare(source, tokenizer, out: Path, workers: int, expected: int | None, shard=None) -> None:
    """Tokenize `source` into `out`; `expected`: its documents where known, for the time left.
    With `shard` (i, n): only this machine's share of the store's shards, published by a run
    without --shard once every share is done."""
    if _check_existing(out, source, tokenizer):
        print(f"{source.name}: already prepared in {out}")
        return
    progress = Progress(source.name, expected, unit="documents", scale=1)
    new_tokens = [0]

    def on_shard(docs: int, tokens: int, reused: bool) -> None:
        # Shards kept from an interrupted run count as done, not as speed.
        progress.add(docs, kept=reused)
        new_tokens[0] += 0 if reused else tokens

    print(f"{source.name}: tokenizing with {workers} workers into {out}", file=sys.stderr)
    start = time.perf_counter()
    meta = build_store(source, tokenizer, out, workers, on_shard=on_shard, shard=shard)
    progress.close()
    if meta is None:
        print(
            f"{source.name}: share {shard[0]}/{shard[1]} tokenized beside {out}; when every "
            "share is done, run once more without --shard to publish the store"
        )
        return
    seconds = time.perf_counter() - start
    kept = f"; {progress.kept:,.0f} documents kept from an interrupted run" if progress.kept else ""
    print(
        f"{source.name}: {meta['num_docs']:,} documents, {meta['num_tokens']:,} tokens "
        f"({meta['dtype']}, {len(meta['shards'])} shards) in {seconds:.2f} s, "
        f"{new_tokens[0] / seconds / 1e6:.2f} M tokens/s{kept} -> {out}\n"
        f"  tokenizer {meta['tokenizer']}"
    )


def main(argv: list[str]) -> int:
    try:
        return _main(argv)
    except (ConfigError, ValueError, FileNotFoundError) as e:  # the user's input: one line
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    # Imported here, not above: each spawned worker re-imports this script, and the option
    # checks import torch (~2.5 s of CPU and ~250 MB per worker) that tokenizing never uses.
    from titanlite.checks import check_options, check_writable
    from titanlite.config_parse import exit_on_help, parse_args
    from titanlite.job import resolve_model

    exit_on_help(argv, __doc__)

    ours = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ours.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ours.add_argument("--out", default="")
    ours.add_argument("--shard", default="", help="i/n: this machine's share (SLURM arrays)")
    args, rest = ours.parse_known_args(argv)
    shard = parse_shard(args.shard)
    if args.workers < 1:
        raise SystemExit(f"--workers must be >= 1, got {args.workers}")
    cfg = parse_args(rest)
    check_options(cfg)
    t = cfg.training
    if is_prepared(t.dataset_path):
        raise SystemExit(f"{t.dataset_path} is already prepared: train with it as dataset_path")
    tokenizer = resolve_model(cfg).tokenizer  # the model's, as train.py resolves it
    source = build_source(
        t.dataset, t.dataset_path, t.dataset_text_column, max_bad_rows=t.dataset_max_bad_rows
    )
    if source.streaming and not args.out:
        print(f"{t.dataset} is streamed and tokenized during training; to prepare it, add --out")
        return 0
    out = (
        Path(args.out).expanduser() if args.out else cache_dir(source, tokenizer, t.data_cache_dir)
    )
    # The store is built beside `out` and renamed into place.
    check_writable(f"{'--out' if args.out else 'the token cache'} {out}: its folder", out.parent)
    expected = expected_documents(t)
    prepare(source, tokenizer, out, args.workers, expected, shard)
    if cfg.validation.dataset_path:
        val = local_source(cfg.validation.dataset_path, t.dataset_text_column)
        val_out = cache_dir(val, tokenizer, t.data_cache_dir)
        prepare(val, tokenizer, val_out, args.workers, None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
