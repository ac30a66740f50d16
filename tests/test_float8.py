"""Float8 training through torchao (titanlite/float8.py): which linears convert, and the checks
that refuse a float8 job before its model is built. Real runs with emulated float8:
tests/integration/test_float8_training.py."""

import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_TRAIN
from torch import nn

import train
from titanlite.config_parse import parse_args
from titanlite.float8 import FLOAT8, maybe_convert_float8, tp_styles
from titanlite.models import get_family
from titanlite.models.decoder.model import Transformer
from titanlite.models.llama.args import get_model_args

F8 = ["--model.converters", FLOAT8, "--quantize.linear.float8.emulate"]
BLOCK_LINEARS = [f"attention.{w}" for w in ("wq", "wk", "wv", "wo")] + [
    f"feed_forward.{w}" for w in ("w1", "w2", "w3")
]


def meta_model() -> nn.Module:
    with torch.device("meta"):
        return Transformer(get_model_args("debugmodel", vocab_size=512, max_seq_len=32))


def qwen3_tied_model() -> nn.Module:
    """Qwen3's tied flavor: QK-norm (not linears) in each block, the output reading the
    embedding."""
    family = get_family("qwen3")
    with torch.device("meta"):
        return family.model_cls(family.model_args("debugmodel_tied", 512, 32))


@pytest.mark.parametrize("build, blocks", [(meta_model, 6), (qwen3_tied_model, 4)],
                         ids=["llama3", "qwen3_tied"])  # fmt: skip
def test_every_block_linear_converts_and_output_stays(build, blocks):
    model = build()
    keys, output = list(model.state_dict()), type(model.output)
    converted = maybe_convert_float8(model, parse_args(F8))
    expected = [f"layers.{i}.{name}" for i in range(blocks) for name in BLOCK_LINEARS]
    assert sorted(converted) == sorted(expected)
    assert {type(model.get_submodule(n)).__name__ for n in expected} == {"Float8Linear"}
    assert type(model.output) is output  # filter_fqns' default, as torchtitan's
    assert list(model.state_dict()) == keys  # checkpoints are the same with or without float8


def test_filter_fqns_keep_matching_linears_in_high_precision():
    model = meta_model()
    cfg = parse_args([*F8, "--quantize.linear.float8.filter_fqns", "output,attention.wq"])
    converted = maybe_convert_float8(model, cfg)
    assert len(converted) == 6 * 6 and not any("wq" in n for n in converted)
    assert type(model.layers["3"].attention.wq) is nn.Linear
    assert type(model.layers["3"].attention.wk).__name__ == "Float8Linear"


@pytest.mark.parametrize(
    "extra, backend, float8_styles",
    [
        ([], "nccl", True),
        (["--quantize.linear.float8.recipe_name", "rowwise"], "nccl", False),  # scales per row
        (["--quantize.linear.float8.filter_fqns", "output,w2"], "nccl", False),  # a plain linear
        ([], "gloo", False),  # gloo cannot all-gather float8 tensors ("Invalid scalar type")
        ([], "cuda:nccl,cpu:gloo", True),  # CPU offload adds gloo for the CPU grads
        (None, "nccl", False),  # no float8 at all
    ],
    ids=["tensorwise_nccl", "rowwise", "partly_float8", "gloo", "offload_nccl", "plain_model"],
)
def test_tp_styles_cast_before_all_gather_only_for_tensorwise_float8_on_nccl(
    extra, backend, float8_styles, monkeypatch
):
    model = meta_model()
    if extra is not None:
        maybe_convert_float8(model, parse_args([*F8, *extra]))
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group: backend)
    mesh = SimpleNamespace(get_group=lambda: None, device_type="cuda")
    styles = tp_styles(model.layers, mesh)
    names = [style.__name__ for style in styles]
    expected = ["ColwiseParallel", "RowwiseParallel", "PrepareModuleInput"]
    if float8_styles:
        expected = ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"]
    assert names == expected


SET = "--quantize.linear.float8."
AG = SET + "enable_fsdp_float8_all_gather"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model.converters", FLOAT8], "CUDA capability 8.9 or newer; this run is on cpu"),
        ([*F8, SET + "recipe_name", "rowwise", AG], "set " + SET + "recipe_name tensorwise"),
        ([*F8, AG], "has no FSDP"),
        ([*F8, SET + "precompute_float8_dynamic_scale_for_fsdp"], "add " + AG),
        ([*F8, "--compile.enable"], "eager mode only"),
        ([*F8, SET + "filter_fqns", "", "--loss.chunk_tokens", "16"], "loss.chunk_tokens 0"),
        ([*F8, SET + "filter_fqns", "layers,output"], "leaves no linear to convert"),
        ([*F8, SET + "recipe_name", "blockwise"], "must be one of tensorwise, rowwise"),
        (["--model.converters", "float8"], "must be one of quantize.linear.float8"),
    ],
    ids=[
        "no_float8_hardware", "all_gather_rowwise", "all_gather_without_fsdp",
        "precompute_without_all_gather", "emulate_with_compile", "float8_output_chunked_loss",
        "nothing_to_convert", "unknown_recipe", "unknown_converter",
    ],
)  # fmt: skip
def test_bad_float8_input_is_one_clear_line(args, expected, tmp_path, capsys):
    assert train.main([*TINY_TRAIN, "--job.dump_folder", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("titanlite: error:")]
    assert len(errors) == 1 and expected in errors[0], err
    assert "Traceback" not in err


def test_missing_torchao_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # `import torchao.float8` fails
    assert train.main([*TINY_TRAIN, "--job.dump_folder", str(tmp_path), *F8]) == 2
    assert "needs torchao: pip install torchao" in capsys.readouterr().err
