"""Run torchtitan v0.2.2's trainer on a CPU, for side_by_side.py's smoke mode (on a GPU that
script runs torchtitan's own entry point, `-m torchtitan.train`, and not this).

torchtitan's files are not changed. This imports torchtitan, replaces at run time what fails on a
CPU-only torch, then calls torchtitan.train.main(Trainer) with this script's arguments:

    RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python scripts/benchmarks/side_by_side_cpu.py --model.name llama3 ...

1. MoE kernels: torchtitan.models.moe.kernels imports triton, which a CPU torch lacks, and every
   import of torchtitan reaches it (through its float8 converter). The dense Llama never calls
   it; without triton the module is replaced by one whose kernel says it needs triton.
2. device type: with no accelerator torchtitan falls back to "cuda" and its modules bind that
   name when imported; here every loaded torchtitan module gets "cpu" and torch.cpu, so the
   process group resolves to gloo.
3. memory monitor and process-group timeouts: as scripts/benchmarks/torchtitan_cpu.py does for
   its commit (the functions have the same form in v0.2.2): peak RSS against physical RAM, and a
   barrier without device ids.
"""

import importlib.util
import sys
import types

import torch
import torchtitan_cpu  # this folder: the replacements shared with torchtitan's newer commit

MOE_KERNELS = "torchtitan.models.moe.kernels"


def stand_in_moe_kernels() -> None:
    if importlib.util.find_spec("triton") is not None:
        return
    module = types.ModuleType(MOE_KERNELS)

    def generate_permute_indices(*args, **kwargs):
        raise NotImplementedError("torchtitan's MoE permutation kernel needs triton")

    module.generate_permute_indices = generate_permute_indices
    sys.modules[MOE_KERNELS] = module


def rebind_device_type() -> list[str]:
    """Every loaded torchtitan module's device_type/device_module set to the CPU's; returns the
    modules changed."""
    changed = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
            changed.append(name)
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = torch.cpu
    return changed


def apply():
    """Every replacement; returns torchtitan.train."""
    stand_in_moe_kernels()
    utils = importlib.import_module("torchtitan.tools.utils")
    torchtitan_cpu.need(utils, "get_device_info")
    utils.get_device_info = lambda: ("cpu", torch.cpu)
    train = importlib.import_module("torchtitan.train")
    if "torchtitan.tools.utils" not in rebind_device_type():
        raise torchtitan_cpu.ShimError(
            "torchtitan.tools.utils has no 'cuda' device_type to replace"
        )
    torchtitan_cpu.patch_memory_monitor(sys.modules["torchtitan.components.metrics"])
    torchtitan_cpu.patch_pg_timeouts(sys.modules["torchtitan.distributed.utils"])
    return train


def main() -> int:
    if torch.cuda.is_available():
        print("side_by_side_cpu: a GPU is here: run `-m torchtitan.train` itself", file=sys.stderr)
        return 2
    try:
        train = apply()
    except ImportError as e:
        print(f"side_by_side_cpu: cannot import torchtitan or its packages: {e}", file=sys.stderr)
        return 2
    except torchtitan_cpu.ShimError as e:
        print(f"side_by_side_cpu: {e}", file=sys.stderr)
        return 2
    train.main(torchtitan_cpu.need(train, "Trainer"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
