"""scripts/convert_checkpoint.py: titanlite <-> Hugging Face Llama give the same logits."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO
from safetensors import safe_open
from safetensors.torch import save_file
from script_runner import load_script
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titanlite.checkpoint import CheckpointManager, plan_load
from titanlite.checkpoint.stream import single_process_quietly
from titanlite.config import Checkpoint
from titanlite.models import get_family
from titanlite.models.decoder.model import Transformer
from titanlite.models.llama.args import ModelArgs, get_model_args

HF = get_family("llama3").hf

transformers = pytest.importorskip("transformers")

SCRIPT = REPO / "scripts" / "convert_checkpoint.py"
conv = load_script("convert_checkpoint")


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
    mgr = CheckpointManager(Checkpoint(), root / "run", model, None, None, None, None)
    mgr.save(0)
    mgr.close()  # the save is published (COMPLETE, renamed) once close() returned
    step_dir = root / "run" / "checkpoint" / "step-0"
    assert conv.main(["dcp-to-hf", str(step_dir), str(root / "hf"), "--flavor", "debugmodel"]) == 0
    return root, args, model, step_dir


def test_dcp_to_hf_gives_the_same_logits(debug_ckpt):
    root, args, model, _ = debug_ckpt
    tokens = torch.randint(0, args.vocab_size, (2, 48))
    with torch.no_grad():
        ours = model(tokens)
    assert (ours - hf_logits(root / "hf", tokens)).abs().max() <= 1e-4


def test_dcp_to_hf_writes_one_shard_per_unit_with_an_index(debug_ckpt):
    root, args, model, _ = debug_ckpt
    index = json.loads((root / "hf" / "model.safetensors.index.json").read_text())
    n_shards = args.n_layers + 2  # embedding, each block, norm + output
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [
        f"model-{i:05d}-of-{n_shards:05d}.safetensors" for i in range(1, n_shards + 1)
    ]
    assert sorted(f.name for f in (root / "hf").glob("*.safetensors")) == shards
    total = 0
    for shard in shards:
        with safe_open(str(root / "hf" / shard), framework="pt") as st:
            assert sorted(st.keys()) == sorted(
                k for k, f in index["weight_map"].items() if f == shard
            )
            total += sum(st.get_tensor(k).nbytes for k in st.keys())  # noqa: SIM118
    assert len(index["weight_map"]) == len(model.state_dict())
    assert index["metadata"]["total_size"] == total
    first_block = {k for k, f in index["weight_map"].items() if f == shards[1]}
    assert first_block == {f"model.layers.0.{hf}" for hf in HF.layer_keys.values()}


@pytest.mark.parametrize("layout", ["sharded", "single_file"])
def test_hf_to_dcp_round_trip_loads_as_initial_weights(debug_ckpt, layout):
    root, args, model, _ = debug_ckpt
    hf_dir = root / "hf"
    if layout == "single_file":  # as many published checkpoints: no index
        hf_dir = root / "hf_single"
        hf_dir.mkdir()
        (hf_dir / "config.json").write_text((root / "hf" / "config.json").read_text())
        save_file(HF.to_hf(model.state_dict(), args, torch.float32),
                  str(hf_dir / "model.safetensors"))  # fmt: skip
    dcp_dir = root / f"from_hf_{layout}"
    assert conv.main(["hf-to-dcp", str(hf_dir), str(dcp_dir)]) == 0
    other = build(args, seed=1)
    opt = torch.optim.AdamW(other.parameters())
    cfg = replace(Checkpoint(), enable=True, initial_load_path=str(dcp_dir))
    mgr = CheckpointManager(cfg, root / f"run_{layout}", other, opt, None, None, None)
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
    hf_cfg = transformers.LlamaConfig(**HF.config(args, "float32"))
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(HF.to_hf(model.state_dict(), args, torch.float32))
    tokens = torch.randint(0, args.vocab_size, (2, 40))
    with torch.no_grad():
        diff = (model(tokens) - hf_logits(hf, tokens)).abs().max()
    assert diff <= 1e-4
    hf_weights = HF.to_hf(model.state_dict(), args, torch.float32)
    convert = HF.from_hf_lazily(hf_weights.__getitem__, hf_cfg.to_dict(), torch.float32)
    back = {ours: make() for ours, (_, make) in convert.items()}
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


def test_dcp_to_torch_all_matches_torch_dcp_to_torch_save(tmp_path):
    """Every key as saved, nested as saved (lists too), like DCP's own whole-state converter."""
    state = {
        "model": {"w": torch.randn(4, 3), "b": torch.randn(3).bfloat16()},
        "optimizer": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
                      "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]},
        "train_state": b"pickled",
        "rng": {"rank0": b"rng"},
    }  # fmt: skip
    with single_process_quietly():
        dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert (
        conv.main(["dcp-to-torch", str(tmp_path / "ckpt"), str(tmp_path / "all.pt"), "--all"]) == 0
    )
    dcp_to_torch_save(str(tmp_path / "ckpt"), str(tmp_path / "reference.pt"))
    ours = torch.load(tmp_path / "all.pt", weights_only=False)
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    assert repr(ours) == repr(reference)
    assert torch.equal(
        ours["optimizer"]["state"]["w"]["exp_avg"], state["optimizer"]["state"]["w"]["exp_avg"]
    )


@pytest.mark.slow
def test_cli_errors_are_one_line_with_the_fix(debug_ckpt, tmp_path, capsys):
    _, _, _, step_dir = debug_ckpt
    stale = tmp_path / "old_export"  # an earlier export there would mix with the new one
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"")
    cases = [
        (["dcp-to-hf", str(step_dir), str(tmp_path / "x"), "--flavor", "8B"], "flavor 8B has dim"),
        (["hf-to-dcp", str(tmp_path), str(tmp_path / "y")], "needs config.json"),
        (["dcp-to-torch", str(tmp_path), str(tmp_path / "z.pt")], "not a DCP checkpoint"),
        (
            ["dcp-to-hf", str(step_dir), str(stale), "--flavor", "debugmodel"],
            "exists and is not empty: remove it or pick another",
        ),
    ]
    for argv, msg in cases:
        assert conv.main(argv) == 2
        assert msg in capsys.readouterr().err, argv
    # once as a user runs it: a real process, exit status 2, one line on stderr
    argv = ["dcp-to-hf", str(step_dir), str(tmp_path / "x")]
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.returncode == 2 and "need --flavor" in proc.stderr, proc.stderr[-2000:]
