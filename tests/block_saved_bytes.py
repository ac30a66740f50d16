"""Worker: one eager Llama block's forward on this CPU, bf16 and fp32, with every rank in TP
(sequence parallel) or CP as argv[1] says (one rank: plain), printing per rank and dtype, as a
JSON line, the bytes autograd saved for its backward beside memory_estimate's figure for them.

Counted once per storage (a view shares its base's bytes), the parameters left out, and RoPE's
rotation, which the estimate leaves out (complex, [seq, head_dim / 2] per block whatever the
batch: under 1% of a real block's activations).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titanlite.memory_estimate import DTYPE_BYTES, MemorySetup, block_activation_elems
from titanlite.models.llama.args import ModelArgs
from titanlite.models.llama.model import Transformer
from titanlite.models.llama.parallelize import apply_cp, apply_tp

# GQA (4 query heads over 2 kv heads, which CPU attention repeats), ffn 256, 2 rows of 16.
ARGS = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32)
ROWS, SEQ = 2, 16


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `t`'s bytes on this rank (a DTensor's shard, a collective's
    output once it has arrived)."""
    t = t._local_tensor if isinstance(t, DTensor) else t
    return t.trigger_wait() if hasattr(t, "trigger_wait") else t


def saved_bytes(dtype: torch.dtype, dim: str, n: int) -> int:
    """Bytes the block's forward saves for backward on this rank, `dim` ("tp" or "cp") of
    degree `n` applied to the model as training applies it."""
    torch.manual_seed(0)
    model = Transformer(ARGS).to(dtype)
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

    block, block_forward = model.layers["0"], model.layers["0"].forward

    def counted_forward(*args):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return block_forward(*args)

    block.forward = counted_forward
    model(torch.randint(0, ARGS.vocab_size, (ROWS, SEQ)))
    return sum(saved.values())


def main(dim: str) -> None:
    n = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    for dtype in ("bfloat16", "float32"):
        measured = saved_bytes(getattr(torch, dtype), dim, n)
        s = MemorySetup(model_args=ARGS, local_batch_size=ROWS, seq_len=SEQ, device="cpu",
                        param_dtype=dtype, **{dim: n})  # fmt: skip
        act = DTYPE_BYTES[dtype]
        estimated = block_activation_elems(s)[0] * act * ROWS * SEQ / s.cp
        if s.cp > 1:
            # CP's two chunk masks, [c, end] additive biases that SDPA keeps (c = SEQ / 2 cp; the
            # ends (r + 1) c and (2 cp - r) c). The estimator counts masks apart, in mask_bytes,
            # and only one call's, not each block's pair (its docstring says so).
            c = SEQ // (2 * s.cp)
            estimated += c * (2 * s.cp + 1) * c * act
        print(json.dumps({"rank": rank, "dtype": dtype, "measured": measured,
                          "estimated": estimated}), flush=True)  # fmt: skip


if __name__ == "__main__":
    launched = "RANK" in os.environ  # by torchrun (or the tests' rank launcher); else one process
    if launched:
        dist.init_process_group("gloo")
    main(sys.argv[1])
    if launched:
        dist.destroy_process_group()
