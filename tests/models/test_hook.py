"""titanlite/models/__init__.py, the model hook: model.name takes only registered families, and a
family registered from outside trains through the real Trainer without touching train.py."""

from dataclasses import replace

import pytest

import train
from titanlite.checks import check_options
from titanlite.config import ConfigError
from titanlite.config_parse import parse_args
from titanlite.distributed import init_distributed
from titanlite.models import FAMILIES, get_family
from titanlite.models.decoder.model import Transformer
from titanlite.models.llama.args import ModelArgs

TOY_FLAVORS = {"tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, multiple_of=32)}


class ToyTransformer(Transformer):
    """A Llama under another name: what a family's own model class looks like to the hook."""


def toy_args(flavor, vocab_size, max_seq_len, use_scaled_rope=False, **overrides):
    base = TOY_FLAVORS[flavor]
    return replace(base, vocab_size=vocab_size, max_seq_len=max_seq_len,
                   use_scaled_rope=use_scaled_rope, **overrides)  # fmt: skip


def test_an_unregistered_name_is_refused_with_the_registered_ones():
    with pytest.raises(ConfigError, match=r"model.name 'foo' is not a registered .*: llama3"):
        check_options(parse_args(["--model.name", "foo"]))
    assert get_family("llama3").model_cls is Transformer


def test_a_family_registered_through_the_hook_trains_a_step(tmp_path, monkeypatch):
    llama3 = get_family("llama3")
    toy = replace(llama3, name="toy", flavors=TOY_FLAVORS, model_args=toy_args,
                  model_cls=ToyTransformer)  # fmt: skip
    monkeypatch.setitem(FAMILIES, "toy", toy)
    argv = ["--job.config_file", "debug_model.toml", "--model.name", "toy"]
    argv += ["--model.flavor", "tiny", "--model.vocab_limit", "512", "--training.steps", "1"]
    argv += ["--training.seq_len", "32", "--training.local_batch_size", "2"]
    argv += ["--metrics.peak_tflops", "1", "--no-metrics.enable_tensorboard"]
    trainer = train.Trainer(parse_args([*argv, "--job.dump_folder", str(tmp_path)]),
                            init_distributed())  # fmt: skip
    try:
        assert isinstance(trainer.model, ToyTransformer)
        assert trainer.model_args.dim == 64 and trainer.model_args.n_layers == 2
        assert trainer.train() == 0 and trainer.state.step == 1
    finally:
        trainer.close()
    assert (tmp_path / "metrics.jsonl").read_text().count('"step": 1') == 1
