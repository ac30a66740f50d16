"""Compute dtype selection: 'auto' follows the hardware's native bf16, explicit choices win."""

import logging
import math

import pytest
import torch

from titanlite import metrics, precision
from titanlite.config import DTYPE_CHOICES
from titanlite.config_parse import parse_args


def _cpu_bf16(monkeypatch, native: bool):
    monkeypatch.setattr(precision, "_cpu_has_native_bf16", lambda: native)


def test_dtype_table_matches_config_choices():
    assert tuple(precision.DTYPES) == DTYPE_CHOICES
    assert precision.DTYPES["float32"] is torch.float32
    assert precision.DTYPES["bfloat16"] is torch.bfloat16


def test_auto_is_the_default_and_the_debug_config_s():
    assert parse_args([]).training.mixed_precision_param == "auto"
    cfg = parse_args(["--job.config_file", "debug_model.toml"])
    assert cfg.training.mixed_precision_param == "auto"


@pytest.mark.parametrize(
    "native, choice, dtype, level, says",
    [
        (False, "auto", torch.float32, logging.INFO, "--training.mixed_precision_param bfloat16"),
        (True, "auto", torch.bfloat16, logging.INFO, "bfloat16"),
        (False, "float32", torch.float32, None, ""),
        (True, "float32", torch.float32, None, ""),
        (False, "bfloat16", torch.bfloat16, logging.WARNING, "emulated"),  # honoured, warned
        (True, "bfloat16", torch.bfloat16, None, ""),
    ],
)
def test_choice_and_what_the_log_says(monkeypatch, caplog, native, choice, dtype, level, says):
    _cpu_bf16(monkeypatch, native)
    with caplog.at_level(logging.INFO, logger="titanlite.precision"):
        assert precision.resolve_param_dtype(choice, torch.device("cpu")) == dtype
    assert [r.levelno for r in caplog.records] == ([level] if level else [])
    assert says in caplog.text


def test_unknown_choice_names_the_choices():
    with pytest.raises(ValueError, match="auto.*float32.*bfloat16.*'float16'"):
        precision.resolve_param_dtype("float16", "cpu")


@pytest.mark.parametrize(
    "caps, native",
    [
        ({"avx2": True, "avx512_bf16": False, "amx_bf16": False}, False),
        ({"avx512_f": True, "avx512_bf16": True}, True),
        ({"amx_tile": True, "amx_bf16": True}, True),
        ({"architecture": "aarch64", "bf16": True}, False),  # conservative: not x86 native bf16
    ],
)
def test_cpu_probe_reads_torch_capabilities(monkeypatch, caps, native):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps, raising=False)
    assert precision.has_fast_bf16(torch.device("cpu")) is native


def test_cpu_probe_falls_back_to_private_probes_on_older_torch(monkeypatch):
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert precision.has_fast_bf16(torch.device("cpu"))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not precision.has_fast_bf16(torch.device("cpu"))


@pytest.mark.parametrize("ampere", [False, True])
def test_cuda_follows_native_bf16_support(monkeypatch, ampere):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: ampere)
    assert precision.has_fast_bf16(torch.device("cuda", 0)) is ampere
    expected = torch.bfloat16 if ampere else torch.float32
    assert precision.resolve_param_dtype("auto", torch.device("cuda", 0)) == expected


def test_unknown_device_type_is_not_fast():
    assert not precision.has_fast_bf16(torch.device("meta"))


@pytest.mark.parametrize("native", [True, False])
def test_cpu_peak_is_the_compute_dtype_s_where_native_else_fp32(monkeypatch, native):
    # Timing is not asserted (shared CPUs); the size is chosen by a time budget (see metrics).
    monkeypatch.setattr(metrics, "_cpu_peak_cache", {})
    monkeypatch.setattr(metrics, "has_fast_bf16", lambda device: native)
    peak = metrics.get_peak_flops(torch.device("cpu"), torch.bfloat16)
    assert peak > 0 and math.isfinite(peak)
    calibrated = torch.bfloat16 if native else torch.float32
    assert list(metrics._cpu_peak_cache) == [(calibrated, torch.get_num_threads())]


@pytest.mark.parametrize("allow, device, expected", [
    (True, "cuda", True), (True, "cpu", False), (False, "cuda", False),
])  # fmt: skip
def test_tf32_only_when_asked_and_only_on_cuda(allow, device, expected):
    matmul = torch.backends.cuda.matmul  # a module-like object monkeypatch cannot patch
    assert not matmul.allow_tf32  # torch's default
    try:
        precision.apply_tf32(allow, torch.device(device))
        assert matmul.allow_tf32 is expected
    finally:
        matmul.allow_tf32 = False
    assert parse_args(["--training.allow_tf32"]).training.allow_tf32
