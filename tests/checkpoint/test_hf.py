"""Hugging Face weights in and out of training runs, no conversion step: a run's last save in HF
format is what transformers loads with the run's logits, a run started from an HF folder (one
process, and FSDP on 2 processes) trains from its weights, heads split by FSDP shards load and
save exactly, and bad inputs stop before training with one line."""

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_TRAIN, load_dcp_model, read_jsonl, torchrun_script, train_many
from safetensors.torch import load_file, save_file

import train
from titanlite.build import model_args_for
from titanlite.checkpoint import MARKER
from titanlite.config_parse import parse_args
from titanlite.data.tokenizer import build_tokenizer
from titanlite.models import get_family
from titanlite.models.decoder.model import Transformer

HF = get_family("llama3").hf

pytestmark = pytest.mark.slow  # every test here runs train.py or torchrun

ONE_STEP = [*TINY_TRAIN, "--training.steps", "1", "--checkpoint.enable"]
FROM_HF0 = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path"]
TWO_BLOCKS = ["--model.flavor", "debugmodel_2L"]  # the tiny run has 4
LAST_IN_HF = ["--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"]


def tiny_model() -> Transformer:
    """The plain one-process model of the tiny runs' config."""
    cfg = parse_args(TINY_TRAIN)
    return Transformer(model_args_for(cfg, build_tokenizer(cfg.model))).eval()


def first_loss(dump: Path) -> float:
    return read_jsonl(dump / "metrics.jsonl")[0]["loss"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """hf0: the weights every fresh tiny run draws (its seed checkpoint), as one safetensors
    file. ref: a fresh run of one step whose last save is its weights in DCP. hf1 / hf2: the
    same step started from hf0 in one process / FSDP on 2 (exported in bfloat16), last save
    in HF."""
    root = tmp_path_factory.mktemp("hf_runs")
    seed = [*TINY_TRAIN, "--job.dump_folder", str(root / "seed")]
    assert train.main([*seed, "--checkpoint.create_seed_checkpoint"]) == 0
    model = load_dcp_model(tiny_model(), root / "seed" / "checkpoint" / "step-0")
    (root / "hf0").mkdir()
    save_file(HF.to_hf(model.state_dict(), model.args, torch.float32),
              str(root / "hf0" / "model.safetensors"))  # fmt: skip
    HF.write_config(root / "hf0", model.args, "float32")

    ref = [*ONE_STEP, "--checkpoint.last_save_model_only", "--job.dump_folder", str(root / "ref")]
    assert train.main(ref) == 0
    from_hf0 = [*ONE_STEP, *LAST_IN_HF, *FROM_HF0, str(root / "hf0")]
    assert train.main([*from_hf0, "--job.dump_folder", str(root / "hf1")]) == 0
    bf16 = ["--checkpoint.export_dtype", "bfloat16"]
    train_many([[*from_hf0, *bf16, "--job.dump_folder", str(root / "hf2")]], nproc=2)
    return {name: root / name for name in ("hf0", "ref", "hf1", "hf2")}


def test_last_save_in_hf_is_what_transformers_loads_with_the_runs_logits(tiny, runs):
    transformers = pytest.importorskip("transformers")
    ours = load_dcp_model(tiny_model(), runs["ref"] / "checkpoint" / "step-1")
    export = runs["hf1"] / "checkpoint" / "step-1"
    # the same weights as the run that saved them in DCP, in HF's names and row order
    want = HF.to_hf(ours.state_dict(), ours.args, torch.float32)
    got = tiny.hf_weights(export)
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    hf = transformers.LlamaForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 32))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() <= 1e-4
    # complete: the run's tokenizer and special ids, loaded by the Auto classes as it is
    tok = build_tokenizer(parse_args(TINY_TRAIN).model)
    hf_tok = transformers.AutoTokenizer.from_pretrained(export)
    text = "def main():\n    return 42"
    assert hf_tok(text)["input_ids"] == tok.encode(text, bos=True, eos=False)
    auto = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert (auto.config.bos_token_id, auto.config.eos_token_id) == (tok.bos_id, tok.eos_id)
    assert auto.generation_config.eos_token_id == tok.eos_id
    marker = json.loads((export / MARKER).read_text())
    assert marker.pop("save_seconds") > 0
    assert marker == {"step": 1, "model_only": True, "format": "hf", "dtype": "float32"}
    assert not (export / "sharded").exists()


def test_a_run_started_from_an_hf_folder_trains_from_its_weights(tiny, runs):
    # hf0 holds the weights a fresh run draws: the first step's loss is the fresh run's.
    ref = first_loss(runs["ref"])
    assert first_loss(runs["hf1"]) == ref
    assert first_loss(runs["hf2"]) == pytest.approx(ref, rel=1e-5)
    # FSDP's export, in bfloat16, is the one-process weights rounded to bfloat16
    one, two = (
        tiny.hf_weights(runs["hf1"] / "checkpoint" / "step-1"),
        tiny.hf_weights(runs["hf2"] / "checkpoint" / "step-1"),
    )
    assert one.keys() == two.keys()
    for name, w in one.items():
        assert two[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(two[name].float(), w, rtol=2**-7, atol=1e-6, msg=name)


def test_bad_inputs_stop_before_training_with_one_line(runs, tmp_path, capsys):
    hf0, dcp_dir = runs["hf0"], runs["ref"] / "checkpoint" / "step-1"
    empty, heads, short = tmp_path / "empty", tmp_path / "heads", tmp_path / "short"
    for folder in (empty, heads, short):
        folder.mkdir()
        (folder / "config.json").write_text((hf0 / "config.json").read_text())
    (heads / "model.safetensors").symlink_to(hf0 / "model.safetensors")
    cfg = json.loads((hf0 / "config.json").read_text())
    (heads / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 8}))
    weights = load_file(str(hf0 / "model.safetensors"))  # another vocabulary's output layer
    save_file({**weights, "lm_head.weight": weights["lm_head.weight"][:512].clone()},
              str(short / "model.safetensors"))  # fmt: skip
    cases = [
        ([*FROM_HF0, str(tmp_path / "nope")], "does not exist"),
        ([*FROM_HF0, str(empty)], "needs config.json and *.safetensors"),
        ([*FROM_HF0, str(dcp_dir)], "is a DCP checkpoint, not a Hugging Face folder"),
        (["--checkpoint.initial_load_path", str(hf0)], "add --checkpoint.initial_load_in_hf"),
        ([*FROM_HF0, str(hf0), "--no-checkpoint.initial_load_model_only"], "holds only model"),
        (["--checkpoint.last_save_in_hf"], "add --checkpoint.last_save_model_only"),
        ([*FROM_HF0, str(heads)], "has 8 attention / 16 key-value heads, the model 16 / 16"),
        ([*FROM_HF0, str(short)], "output.weight: saved (512, 256), model (640, 256)"),
        # Every weight a smaller flavor asks for is there: the extra blocks must be named.
        ([*FROM_HF0, str(hf0), *TWO_BLOCKS], "holds 4 blocks, the model 2 (wrong flavor?)"),
        (["--checkpoint.initial_load_path", str(dcp_dir), *TWO_BLOCKS], "holds 4 blocks"),
    ]
    for args, msg in cases:
        argv = [*ONE_STEP, *args, "--job.dump_folder", str(tmp_path / "run")]
        assert train.main(argv) == 2, args
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if line.startswith("titanlite: error:")]
        assert len(lines) == 1 and msg in lines[0], (args, err[-2000:])
        assert "training from step" not in out, args


def test_fsdp_shards_that_split_a_head_load_and_save_exactly(tmp_path):
    torchrun_script(Path(__file__).with_name("workers.py"), "split_heads", tmp_path, nproc=2)
