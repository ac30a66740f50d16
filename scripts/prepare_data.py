"""Tokenize a data source into the token cache ahead of training (the loaders' own function).

Takes the same options as train.py (only model.* tokenizer fields, training.dataset*,
training.data_cache_dir and validation.dataset_path matter):

    python scripts/prepare_data.py --job.config_file debug_model
    python scripts/prepare_data.py --training.dataset local --training.dataset_path 'data/*.jsonl'

Hub datasets (c4, fineweb) are streamed and tokenized on the fly during training: nothing to do.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from titanlite.config import parse_args  # noqa: E402
from titanlite.data.cache import prepare_token_cache  # noqa: E402
from titanlite.data.sources import build_source, local_source  # noqa: E402
from titanlite.data.tokenizer import build_tokenizer  # noqa: E402


def prepare(source, tokenizer, data_cache_dir: str) -> None:
    start = time.perf_counter()
    cache = prepare_token_cache(source, tokenizer, data_cache_dir)
    seconds = time.perf_counter() - start
    meta = cache.meta
    how = "tokenized" if cache.built else "already cached"
    print(f"{source.name}: {how} in {seconds:.2f} s -> {cache.path}")
    rate = meta["num_tokens"] / max(meta["seconds"], 1e-9) / 1e6
    print(
        f"  tokens {meta['num_tokens']:,}  docs {meta['num_docs']:,}  "
        f"tokenizer {meta['tokenizer']}  (built in {meta['seconds']:.2f} s, {rate:.2f} Mtok/s)"
    )


def main(argv: list[str]) -> int:
    cfg = parse_args(argv)
    t = cfg.training
    tokenizer = build_tokenizer(cfg.model)
    source = build_source(t.dataset, t.dataset_path, t.dataset_text_column)
    if source.streaming:
        print(f"{t.dataset} is streamed from the hub and tokenized during training; nothing to do")
        return 0
    prepare(source, tokenizer, t.data_cache_dir)
    if cfg.validation.dataset_path:
        val = local_source(cfg.validation.dataset_path, t.dataset_text_column)
        prepare(val, tokenizer, t.data_cache_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
