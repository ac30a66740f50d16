"""scripts/convert_checkpoint.py: titanlite <-> Hugging Face Llama give the same logits."""

import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from titanlite.checkpoint import CheckpointManager, plan_load
from titanlite.config import Checkpoint
from titanlite.models.llama.args import ModelArgs, get_model_args
from titanlite.models.llama.model import Transformer

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "convert_checkpoint.py"
_spec = importlib.util.spec_from_file_location("convert_checkpoint", SCRIPT)
conv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conv)


def build(args, seed):
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model.eval()


def hf_logits(path_or_model, tokens):
    hf = path_or_model
    if not isinstance(hf, torch.nn.Module):
        hf = transformers.LlamaForCausalLM.from_pretrained(path_or_model, dtype=torch.float32)
    with torch.no_grad():
        return hf.eval()(tokens).logits


@pytest.fixture(scope="module")
def debug_ckpt(tmp_path_factory):
    """A debug-shaped model (small vocab) saved as a seed checkpoint, and its HF export."""
    root = tmp_path_factory.mktemp("convert")
    args = get_model_args("debugmodel", vocab_size=512, max_seq_len=64)
    model = build(args, seed=0)
    CheckpointManager(Checkpoint(), root / "run", model, None, None, None, None).save(0)
    step_dir = root / "run" / "checkpoint" / "step-0"
    assert conv.main(["dcp-to-hf", str(step_dir), str(root / "hf"), "--flavor", "debugmodel"]) == 0
    return root, args, model, step_dir


def test_dcp_to_hf_gives_the_same_logits(debug_ckpt):
    root, args, model, _ = debug_ckpt
    tokens = torch.randint(0, args.vocab_size, (2, 48))
    with torch.no_grad():
        ours = model(tokens)
    assert (ours - hf_logits(root / "hf", tokens)).abs().max() <= 1e-4


def test_hf_to_dcp_round_trip_loads_as_initial_weights(debug_ckpt):
    root, args, model, _ = debug_ckpt
    assert conv.main(["hf-to-dcp", str(root / "hf"), str(root / "from_hf")]) == 0
    other = build(args, seed=1)
    opt = torch.optim.AdamW(other.parameters())
    cfg = replace(Checkpoint(), enable=True, initial_load_path=str(root / "from_hf"))
    mgr = CheckpointManager(cfg, root / "run2", other, opt, None, None, None)
    assert mgr.load(plan_load(cfg, root / "run2")) == 0
    for (name, p), q in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(p, q), name  # the permutation is exactly inverted
    tokens = torch.randint(0, args.vocab_size, (2, 48))
    with torch.no_grad():
        assert torch.equal(model(tokens), other(tokens))


def test_gqa_and_scaled_rope_match_hf():
    args = ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
        use_scaled_rope=True, max_seq_len=64,
    )  # fmt: skip
    model = build(args, seed=2)
    hf_cfg = transformers.LlamaConfig(**conv.hf_config(args, "float32"))
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(conv.to_hf(model.state_dict(), args, torch.float32))
    tokens = torch.randint(0, args.vocab_size, (2, 40))
    with torch.no_grad():
        diff = (model(tokens) - hf_logits(hf, tokens)).abs().max()
    assert diff <= 1e-4
    back = conv.from_hf(
        conv.to_hf(model.state_dict(), args, torch.float32), hf_cfg.to_dict(), torch.float32
    )
    for name, p in model.state_dict().items():
        assert torch.equal(p, back[name]), name


def test_dcp_to_torch_file_with_export_dtype(debug_ckpt):
    root, _, model, step_dir = debug_ckpt
    out = root / "model.pt"
    assert conv.main(["dcp-to-torch", str(step_dir), str(out), "--dtype", "bfloat16"]) == 0
    sd = torch.load(out, weights_only=True)
    assert sd.keys() == model.state_dict().keys()
    for name, p in model.state_dict().items():
        assert sd[name].dtype == torch.bfloat16 and torch.equal(sd[name], p.bfloat16()), name


@pytest.mark.slow
def test_cli_errors_are_one_line_with_the_fix(debug_ckpt, tmp_path, capsys):
    root, _, _, step_dir = debug_ckpt
    cases = [
        (["dcp-to-hf", str(step_dir), str(tmp_path / "x"), "--flavor", "8B"], "flavor 8B has dim"),
        (["hf-to-dcp", str(tmp_path), str(tmp_path / "y")], "needs config.json"),
        (["dcp-to-torch", str(tmp_path), str(tmp_path / "z.pt")], "not a DCP checkpoint"),
    ]
    for argv, msg in cases:
        assert conv.main(argv) == 2
        assert msg in capsys.readouterr().err, argv
    # once as a user runs it: a real process, exit status 2, one line on stderr
    argv = ["dcp-to-hf", str(step_dir), str(tmp_path / "x")]
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.returncode == 2 and "need --flavor" in proc.stderr, proc.stderr[-2000:]
