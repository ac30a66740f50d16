"""Worker: an eager two-block Llama's forward on this CPU, bf16 and fp32, with every rank in TP
(sequence parallel) or CP as argv[1] says (one rank: plain; "doc": one rank, with the sdpa
backend's dense document mask), printing per rank and dtype, as a JSON line, the bytes autograd
saved for the blocks' backward beside memory_estimate's figure for them.

Counted once per storage (a view shares its base's bytes), the parameters left out, and RoPE's
rotation, which the estimate leaves out (complex, [seq, head_dim / 2] per block whatever the
batch: under 1% of a real block's activations).
"""

import json
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titanlite.memory_estimate import (
    DTYPE_BYTES,
    MemorySetup,
    block_activation_elems,
    mask_bias_bytes,
)
from titanlite.models.decoder.model import Transformer
from titanlite.models.decoder.parallelize import apply_cp, apply_tp
from titanlite.models.llama.args import ModelArgs

# GQA (4 query heads over 2 kv heads, which CPU attention repeats), ffn 256, 2 rows of 16; two
# blocks, so that what each block keeps (its mask's bias among it) is counted per block.
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32)
DOCS = replace(ARGS, document_masking=True, bos_id=1, eos_id=2)
ROWS, SEQ = 2, 16


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `t`'s bytes on this rank (a DTensor's shard, a collective's
    output once it has arrived)."""
    t = t._local_tensor if isinstance(t, DTensor) else t
    return t.trigger_wait() if hasattr(t, "trigger_wait") else t


def saved_bytes(dtype: torch.dtype, dim: str, n: int) -> int:
    """Bytes the blocks' forward saves for backward on this rank, `dim` ("tp" or "cp") of degree
    `n` applied to the model as training applies it ("doc": the document-masked model)."""
    torch.manual_seed(0)
    model = Transformer(DOCS if dim == "doc" else ARGS).to(dtype)
    model.init_buffers()  # RoPE's cache in fp32, as training keeps it
    if n > 1 and dim == "tp":
        apply_tp(model, init_device_mesh("cpu", (n,)), shard_logits=False)
    elif n > 1:
        apply_cp(model, init_device_mesh("cpu", (n,)))
    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        t = local(t)
        if t.untyped_storage().data_ptr() not in params and not t.is_complex():
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def counted(block_forward):
        def forward(*args):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return block_forward(*args)

        return forward

    for block in model.layers.values():
        block.forward = counted(block.forward)
    tokens = torch.randint(3, ARGS.vocab_size, (ROWS, SEQ))
    tokens[:, 6:8] = torch.tensor([DOCS.eos_id, DOCS.bos_id])  # a second document in each row
    model(tokens)
    return sum(saved.values())


def main(dim: str) -> None:
    n = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    for dtype in ("bfloat16", "float32"):
        measured = saved_bytes(getattr(torch, dtype), dim, n)
        degrees = {dim: n} if dim in ("tp", "cp") else {}
        s = MemorySetup(model_args=DOCS if dim == "doc" else ARGS, local_batch_size=ROWS,
                        seq_len=SEQ, device="cpu", param_dtype=dtype, **degrees)  # fmt: skip
        per_block = block_activation_elems(s)[0] * DTYPE_BYTES[dtype] * ROWS * SEQ / s.cp
        estimated = ARGS.n_layers * (per_block + mask_bias_bytes(s))
        print(json.dumps({"rank": rank, "dtype": dtype, "measured": measured,
                          "estimated": estimated}), flush=True)  # fmt: skip


if __name__ == "__main__":
    launched = "RANK" in os.environ  # by torchrun (or the tests' rank launcher); else one process
    if launched:
        dist.init_process_group("gloo")
    main(sys.argv[1])
    if launched:
        dist.destroy_process_group()
