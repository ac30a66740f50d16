"""The chunked loss under tensor parallelism equals the plain loss of one process."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port
from test_loss import B, D, S, assert_close_fp32, loss_and_grads, plain

from titanlite.distributed import destroy
from titanlite.loss import IGNORE_INDEX
from titanlite.models.decoder.tp_loss import tp_linear_cross_entropy_sum

pytestmark = pytest.mark.slow  # every test here launches processes


def _tp_worker(rank, world, port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    # vocab 37 over 2 ranks shards unevenly (19 + 18 rows); 7 does not divide N = 48.
    for vocab, chunk_tokens in [(37, 7), (40, 48)]:
        g = torch.Generator().manual_seed(vocab)
        h = torch.randn(B, S, D, generator=g)
        w = torch.randn(vocab, D, generator=g) * D**-0.5
        labels = torch.randint(0, vocab, (B, S), generator=g)
        labels[0, :5] = IGNORE_INDEX
        # As under the TP plan: sequence-parallel hidden states, vocab-sharded output weight.
        h_dt = distribute_tensor(h, mesh, [Shard(1)]).requires_grad_()
        w_dt = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        loss = tp_linear_cross_entropy_sum(h_dt, w_dt, labels, chunk_tokens)
        (loss * 0.5).backward()
        ref = loss_and_grads(plain, h, w, labels, scale=0.5)
        got = (loss.detach(), h_dt.grad.full_tensor(), w_dt.grad.full_tensor())
        for a, b in zip(got, ref, strict=True):
            assert_close_fp32(a, b)  # the tolerance's derivation is in test_loss.py
    destroy()  # barrier first: gloo aborts a rank whose peer leaves mid-exchange


def test_tensor_parallel_matches_plain():
    # A failure in either rank re-raises here with that rank's traceback.
    mp.spawn(_tp_worker, args=(2, free_port()), nprocs=2)
