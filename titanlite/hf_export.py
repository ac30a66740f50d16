"""What makes an HF weights folder a complete model: its tokenizer files, the special-token ids in
config.json, and generation_config.json, so that transformers' Auto classes and lm-eval's `hf`
model load it with no manual step.

The tokenizer: when the run read a Hugging Face tokenizer (model.tokenizer_path naming a
tokenizer.json or a folder holding one), its files are copied as they are; otherwise (a tiktoken
encoding or BPE rank file) tokenizer.json is converted from the encoding with the run's ids
(titanlite.data.hf_tokenizer). Either way the ids in config.json are the run's tokenizer's.
titanlite has no padding token; the export names EOS as one, for batched generation.
"""

import json
import shutil
from pathlib import Path

from titanlite.data.hf_tokenizer import tokenizer_from_tiktoken

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_tokenizer_dir(tokenizer_path: str) -> Path | None:
    """The folder of the HF tokenizer the run read, or None when it read a tiktoken one."""
    path = Path(tokenizer_path).expanduser() if tokenizer_path else None
    if path is None:
        return None
    if path.is_file() and path.name.endswith(".json"):
        return path.parent
    return path if (path / "tokenizer.json").is_file() else None


def check_export_folder(out: Path) -> None:
    """An export never mixes with an earlier one: loaders would read both."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"export folder {out} exists and is not empty: remove it or pick another")


def _special_tokens(tokenizer) -> dict[str, str]:
    eos = tokenizer.decode([tokenizer.eos_id])
    return {"bos_token": tokenizer.decode([tokenizer.bos_id]), "eos_token": eos, "pad_token": eos}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_tokenizer_files(out: Path, tokenizer, tokenizer_path: str, max_len: int) -> None:
    source = hf_tokenizer_dir(tokenizer_path)
    if source is None:
        tokenizer_from_tiktoken(tokenizer.encoding, tokenizer.bos_id).save(
            str(out / "tokenizer.json")
        )
    for name in HF_TOKENIZER_FILES:
        if source is not None and (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    specials = _special_tokens(tokenizer)
    if not (out / "tokenizer_config.json").is_file():
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
        }
        _write_json(out / "tokenizer_config.json", config)
    if not (out / "special_tokens_map.json").is_file():
        _write_json(out / "special_tokens_map.json", specials)


def write_export_files(out: Path, tokenizer, tokenizer_path: str, max_len: int) -> None:
    """Complete the weights folder `out` (config.json written): tokenizer files, the run's special
    ids in config.json, generation_config.json (which suppresses the padding ids)."""
    write_tokenizer_files(out, tokenizer, tokenizer_path, max_len)
    ids = {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.eos_id,
    }
    config = json.loads((out / "config.json").read_text())
    # transformers >= 5 names the dtype "dtype"; older ones read "torch_dtype".
    _write_json(out / "config.json", {**config, **ids, "dtype": config["torch_dtype"]})
    # The vocabulary's padding rows (past the tokenizer's ids) decode to nothing, and titanlite's
    # generate never chooses them; a barely trained model may still rank one first, so
    # transformers' generate is told to suppress them too.
    padding = list(range(tokenizer.n_words, config["vocab_size"]))
    _write_json(out / "generation_config.json", {**ids, "suppress_tokens": padding or None})
