"""Float8 training through torchao: torchtitan's `quantize.linear.float8` model converter.

The model stays plain PyTorch. `maybe_convert_float8` swaps its nn.Linear modules for torchao's
Float8Linear on the meta-built model, before TP and FSDP (torchtitan's order). A Float8Linear
keeps its weight in high precision under the same name (state-dict keys and checkpoints do not
change); each matmul casts its two operands to float8 with dynamic scales (one per tensor, or
per row for the rowwise recipes) and multiplies them with `torch._scaled_mm`, which needs a GPU
of CUDA capability 8.9+. `emulate` does the same casts and multiplies the dequantized values with
ordinary matmuls: the same numerics on any device, for testing.

With TP on NCCL, blocks whose linears are all tensorwise float8 use torchao's float8 TP styles
(`tp_styles`): activations are cast before their all-gather, which then moves float8 bytes.
With FSDP, `enable_fsdp_float8_all_gather` makes the weights all-gather in float8 too, and
`float8_after_optimizer_step` computes all their scales in one all-reduce after each step.
"""

import logging
import sys
from collections.abc import Callable
from dataclasses import replace

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from titanlite.config import ConfigError
from titanlite.distributed import device_backend

logger = logging.getLogger("titanlite")

FLOAT8 = "quantize.linear.float8"  # the converter's name in model.converters


def float8_enabled(cfg) -> bool:
    return FLOAT8 in cfg.model.converters


def torchao_float8():
    try:
        import torchao.float8
    except ImportError:
        raise ConfigError(
            f"--model.converters {FLOAT8} needs torchao: pip install torchao (or "
            "pip install -e '.[float8]')"
        ) from None
    return torchao.float8


def filtered(fqn: str, filter_fqns: list[str]) -> bool:
    return any(f in fqn for f in filter_fqns)


def _convertible(module: nn.Module, fqn: str, filter_fqns: list[str]) -> bool:
    """torchtitan's filter: linears whose name contains no filter_fqns entry, with both dims
    multiples of 16 (what float8 matmul kernels accept)."""
    rows, cols = module.weight.shape
    return not filtered(fqn, filter_fqns) and rows % 16 == 0 and cols % 16 == 0


def maybe_convert_float8(model: nn.Module, cfg) -> list[str]:
    """Swap `model`'s convertible nn.Linear modules for Float8Linear in place (on meta, before
    TP and FSDP); returns the converted module names."""
    if not float8_enabled(cfg):
        return []
    f8, ao = cfg.quantize.linear.float8, torchao_float8()
    config = replace(
        ao.Float8LinearConfig.from_recipe_name(f8.recipe_name),
        emulate=f8.emulate,
        enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather,
    )
    converted, kept = [], []

    def convert(module: nn.Module, fqn: str) -> bool:
        ok = _convertible(module, fqn, f8.filter_fqns)
        (converted if ok else kept).append(fqn)
        return ok

    ao.convert_to_float8_training(model, module_filter_fn=convert, config=config)
    if not converted:
        raise ConfigError(
            f"float8: quantize.linear.float8.filter_fqns {f8.filter_fqns} leaves no linear to "
            "convert (dims must also be multiples of 16)"
        )
    if f8.enable_fsdp_float8_all_gather:
        for fqn in converted:
            model.get_submodule(fqn).register_state_dict_post_hook(_save_plain_weight)
    logger.info(
        "float8 (%s%s): %d linears converted; kept in high precision: %s",
        f8.recipe_name, ", emulated" if f8.emulate else "", len(converted), kept or "none",
    )  # fmt: skip
    return converted


def _save_plain_weight(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """With float8 all-gather the weight is torchao's tensor subclass (it casts itself for FSDP);
    checkpoints get the plain tensor inside it (same storage, so a load fills the weight), which
    any run can read, float8 or not: DCP's weights-only reader refuses the subclass."""
    key = prefix + "weight"
    weight = state_dict[key]
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    inner = getattr(local, "_tensor", local)  # torchao's attribute for the wrapped tensor
    if isinstance(weight, DTensor):
        inner = DTensor.from_local(
            inner, weight.device_mesh, weight.placements, shape=weight.shape,
            stride=weight.stride(),
        )  # fmt: skip
    state_dict[key] = inner


def _float8_linear_class() -> type | None:
    # torchao is loaded whenever a model was converted: looking needs no 3-second import.
    return getattr(sys.modules.get("torchao.float8.float8_linear"), "Float8Linear", None)


def _tensorwise_float8(module: nn.Module) -> bool:
    float8_linear = _float8_linear_class()
    if float8_linear is None or not isinstance(module, float8_linear):
        return False
    c = module.config
    casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output)
    return all(cast.scaling_granularity.value == "tensorwise" for cast in casts)


def tp_styles(modules: nn.Module, tp_mesh: DeviceMesh) -> tuple[type, type, type]:
    """(ColwiseParallel, RowwiseParallel, PrepareModuleInput) for the TP plan of `modules` (the
    blocks): torchao's float8 versions, which cast activations before their all-gather, when
    every linear in them is tensorwise float8 and TP runs on NCCL; torch's otherwise, which
    all-gather in high precision (torchtitan does so for the rowwise recipes; gloo cannot
    all-gather float8 tensors: "Invalid scalar type")."""
    linears = [m for m in modules.modules() if isinstance(m, nn.Linear)]
    float8 = linears and all(_tensorwise_float8(m) for m in linears)
    if not float8 or device_backend(tp_mesh.get_group(), tp_mesh.device_type) != "nccl":
        return ColwiseParallel, RowwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def float8_after_optimizer_step(cfg) -> Callable[[nn.Module], None]:
    """What the trainer calls on the model after each optimizer step: with
    precompute_float8_dynamic_scale_for_fsdp, the scales of every float8 weight in one
    all-reduce (instead of one per weight at its all-gather); else nothing."""
    if float8_enabled(cfg) and cfg.quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp:
        return torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    return lambda model: None
