"""Which dtype training computes in: bf16 where the hardware has fast bf16, else fp32.

Contract:
- `DTYPES` is the one name -> torch.dtype table, for the names in `config.DTYPE_CHOICES`.
- `resolve_param_dtype("auto", device)` is bf16 on hardware with native bf16 matmuls (CUDA
  compute capability >= 8 or ROCm; x86 CPUs with AVX512-BF16 or AMX-BF16) and fp32 everywhere
  else, because an emulated bf16 matmul is slower than fp32 (about 50x on an AVX2-only CPU). It
  logs one info line saying which and why.
- An explicit "float32" or "bfloat16" is always honoured; forcing bf16 where it is emulated logs
  a warning, never an error.

The probe is conservative: a wrong "fast" costs a 50x slowdown, a wrong "slow" about 2x, so CPUs
that torch does not report as AVX512-BF16/AMX (ARM included) get fp32 under "auto".
"""

import logging

import torch

from titanlite.config import DTYPE_CHOICES

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_CHOICES}


def _cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16, as torch's cpuinfo reports them."""
    if hasattr(torch.cpu, "get_capabilities"):  # public in torch 2.13
        caps = torch.cpu.get_capabilities()
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    # Older torch (2.11): private probes, each guarded.
    return any(
        getattr(torch.cpu, probe, lambda: False)()
        for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )


def has_fast_bf16(device: torch.device) -> bool:
    """True where a bf16 matmul runs natively (not emulated) on `device`."""
    device = torch.device(device)
    if device.type == "cuda":
        # Ampere+ (or ROCm); pre-Ampere GPUs emulate bf16.
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return _cpu_has_native_bf16()
    return False


def resolve_param_dtype(choice: str, device: torch.device) -> torch.dtype:
    """The compute (FSDP param) dtype for `training.mixed_precision_param`."""
    device = torch.device(device)
    if choice == "auto":
        if has_fast_bf16(device):
            logger.info(f"compute dtype bfloat16: {_describe(device)} has native bf16")
            return torch.bfloat16
        logger.info(
            f"compute dtype float32: {_describe(device)} has no native bf16; emulated bf16 would "
            "be much slower (~50x on an AVX2 CPU). Set --training.mixed_precision_param bfloat16 "
            "to force it"
        )
        return torch.float32
    if choice not in DTYPES:
        raise ValueError(
            f"training.mixed_precision_param must be one of {['auto', *DTYPES]}, got {choice!r}"
        )
    dtype = DTYPES[choice]
    if dtype == torch.bfloat16 and not has_fast_bf16(device):
        logger.warning(
            f"training.mixed_precision_param = bfloat16, but {_describe(device)} has no native "
            "bf16: it is emulated and can be ~50x slower than float32. Use 'auto' or 'float32' "
            "unless you need bf16 numerics"
        )
    return dtype


def _describe(device: torch.device) -> str:
    if device.type == "cpu":
        return f"this CPU ({torch.backends.cpu.get_cpu_capability()})"
    return str(device)


def apply_tf32(allow: bool, device: torch.device) -> None:
    """training.allow_tf32: cuBLAS runs float32 matmuls on tensor cores with TF32 inputs (7-8x
    the fp32 peak of an A100 or H100 datasheet; 10 mantissa bits instead of 23). Only cuBLAS's
    flag: CPU matmuls keep full precision. Off, torch's default is left as it is."""
    if allow and torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        logger.info("float32 matmuls run in TF32 (training.allow_tf32)")
