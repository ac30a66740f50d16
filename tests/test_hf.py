"""titanlite.hf: the permutation into HF's RoPE row order, done in place in a safetensors file.
(Names, config and the round trip with transformers: tests/scripts/test_convert_checkpoint.py.)"""

import torch
from safetensors.torch import load_file, save_file

from titanlite.hf import from_hf_rope, to_hf_rope, to_hf_rope_in_file


def test_rows_go_into_hf_order_in_place_and_nothing_else_moves(tmp_path):
    path = tmp_path / "model.safetensors"
    q, k, norm = torch.randn(4 * 8, 6).bfloat16(), torch.randn(2 * 8, 6), torch.randn(6)
    save_file({"q": q, "k": k, "norm": norm}, str(path))
    to_hf_rope_in_file(path, "q", n_heads=4)
    got = load_file(str(path))
    assert torch.equal(got["q"], to_hf_rope(q, 4)) and not torch.equal(got["q"], q)
    assert torch.equal(from_hf_rope(got["q"], 4), q)
    assert torch.equal(got["k"], k) and torch.equal(got["norm"], norm)
