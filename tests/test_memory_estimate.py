"""Memory estimator arithmetic on small hand-checkable cases (no timings, no GPU)."""

import subprocess
import sys
from dataclasses import replace

import pytest

from titanlite.config import parse_args
from titanlite.memory_estimate import (
    GIB,
    MemorySetup,
    activation_bytes,
    estimate,
    loss_bytes,
    param_counts,
    setup_from_config,
)
from titanlite.models.llama.args import ModelArgs

# dim 64, 2 layers, 4 heads (head_dim 16), ffn 256 (multiple_of 256), vocab 128.
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32)
REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def setup(**kw) -> MemorySetup:
    base = dict(model_args=ARGS, local_batch_size=2, seq_len=16, device="cuda")
    return MemorySetup(**{**base, **kw})


def test_param_counts_by_hand():
    c = param_counts(ARGS)
    block = 4 * 64 * 64 + 3 * 64 * 256 + 2 * 64  # wq wk wv wo, w1 w2 w3, two norms
    root = 128 * 64 * 2 + 64  # embedding, output, final norm
    assert c["block"] == block
    assert c["root"] == root
    assert c["total"] == 2 * block + root
    assert c["replicated"] == 2 * 2 * 64 + 64  # norms only
    assert c["tp_split"] == c["total"] - c["replicated"]


def test_fsdp_splits_params_grads_and_states_1_over_n():
    one = estimate(setup()).rows
    four = estimate(setup(dp_shard=4)).rows
    total = param_counts(ARGS)["total"]
    assert one["params (fp32, sharded)"] == total * 4
    for key, per_param in (
        ("params (fp32, sharded)", 4),
        ("grads (fp32, sharded)", 4),
        ("AdamW states (2 x fp32)", 8),
    ):
        assert four[key] == pytest.approx(total * per_param / 4)


def test_hsdp_replication_does_not_shard():
    rows = estimate(setup(dp_replicate=2, dp_shard=2)).rows
    assert rows["params (fp32, sharded)"] == pytest.approx(param_counts(ARGS)["total"] * 4 / 2)


def test_tp_splits_matmul_weights_not_norms():
    c = param_counts(ARGS)
    rows = estimate(setup(tp=2)).rows
    assert rows["params (fp32, sharded)"] == pytest.approx(
        (c["tp_split"] / 2 + c["replicated"]) * 4
    )


def test_tp_divides_activations_except_gathered_norm_outputs():
    tokens, dim, ffn = 32, 64, 256
    fp32 = dict(param_dtype="float32")
    full_1 = 2 * dim + 2 * dim + 5 * dim + 4 * ffn  # per token, per block
    full_2 = 2 * dim / 2 + 2 * dim + (5 * dim + 4 * ffn) / 2
    # 2 blocks saved + 1 block of gradient buffers, fp32.
    assert activation_bytes(setup(**fp32)) == pytest.approx(tokens * 3 * full_1 * 4)
    assert activation_bytes(setup(tp=2, **fp32)) == pytest.approx(tokens * 3 * full_2 * 4)


def test_cp_splits_tokens_and_shards_params_over_dp_shard_x_cp():
    """CP 2: half of each sequence per rank, the whole sequence's K and V (kv_dim 64 x 2 per
    local token) saved by attention instead of repeated local ones, the late chunk's mask."""
    tokens, dim, ffn, kv = 32 // 2, 64, 256, 64
    fp32 = dict(param_dtype="float32")
    full = 2 * dim + 2 * dim + 3 * dim + 2 * kv * 2 + 4 * ffn  # per local token, per block
    mask = 16 // 4 * 16 * (1 + 4)  # [seq / (2 cp), seq] bools + fp32 bias
    assert activation_bytes(setup(cp=2, **fp32)) == pytest.approx(tokens * 3 * full * 4 + mask)
    rows = estimate(setup(cp=2, dp_shard=2)).rows
    assert rows["params (fp32, sharded)"] == pytest.approx(param_counts(ARGS)["total"] * 4 / 4)
    assert loss_bytes(setup(cp=2)) == loss_bytes(setup(seq_len=8))


def test_cpu_composite_rmsnorm_saves_its_normalized_input_too():
    fp32 = dict(param_dtype="float32")
    extra = activation_bytes(setup(device="cpu", **fp32)) - activation_bytes(setup(**fp32))
    assert extra == pytest.approx(32 * 3 * 2 * 64 * 4)  # 32 tokens, 3 blocks' worth, 2 norms


def test_activation_checkpointing_reduces_activations():
    big = replace(ARGS, n_layers=8)
    none = activation_bytes(setup(model_args=big))
    sel = activation_bytes(setup(model_args=big, ac_mode="selective"))
    every2 = activation_bytes(setup(model_args=big, ac_mode="selective", selective_ac_option="2"))
    full = activation_bytes(setup(model_args=big, ac_mode="full"))
    full32 = activation_bytes(setup(model_args=big, ac_mode="full", param_dtype="float32"))
    assert full < sel < none
    assert full < every2 < none
    # Full AC: 8 block inputs (dim each) + one rebuilt block + one block of grad buffers.
    per_block = 2 * 64 + 2 * 64 + 5 * 64 + 4 * 256
    assert full32 == pytest.approx(32 * (8 * 64 + 2 * per_block) * 4)


def test_chunked_loss_reduces_loss_memory():
    big_vocab = replace(ARGS, vocab_size=4096)
    plain = loss_bytes(setup(model_args=big_vocab, seq_len=32))
    chunked = loss_bytes(setup(model_args=big_vocab, seq_len=32, chunk_tokens=8))
    # bf16 (FSDP over one rank): 3 fp32 copies + 1 bf16 of [64 tokens, 4096] vs one 8-token
    # chunk (fp32 + bf16), the fp32 [64, 64] input gradient and the [4096, 64] weight gradient
    # in the unsharded weight's bf16.
    assert plain == 64 * 4096 * 14
    assert chunked == 8 * 4096 * 6 + 64 * 64 * 4 + 4096 * 64 * 2
    assert chunked < plain


def test_cpu_offload_keeps_params_grads_and_states_off_the_device():
    """Only the step's working set stays: FSDP's gathered weights, activations, the loss."""
    kept = ("unsharded weights / casts", "activations (AC none)", "logits / loss")
    for dp_shard in (1, 2):  # one rank too: FSDP then wraps the model just to offload it
        fp32 = setup(dp_shard=dp_shard, param_dtype="float32")
        offloaded = estimate(replace(fp32, cpu_offload=True)).rows
        for key in ("params (fp32, sharded)", "grads (fp32, sharded)", "AdamW states (2 x fp32)"):
            assert offloaded[key] == 0
        assert offloaded[kept[0]] > 0
        if dp_shard == 2:
            assert [offloaded[k] for k in kept] == [estimate(fp32).rows[k] for k in kept]
    cfg = parse_args(["--training.enable_cpu_offload"])
    assert setup_from_config(cfg, world_size=2, vocab_size=128).cpu_offload


def test_bad_setup_is_a_value_error():
    with pytest.raises(ValueError, match="ac_mode"):
        setup(ac_mode="sometimes")
    with pytest.raises(ValueError, match="selective_ac_option"):
        setup(ac_mode="selective", selective_ac_option="x")


@pytest.mark.slow
def test_cli_8b_fsdp8():
    out = subprocess.run(
        [
            sys.executable, str(REPO / "scripts/estimate_memory.py"),
            "--job.config_file", "llama_8b.toml", "--world_size", "8", "--vocab_size=128256",
        ],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout  # fmt: skip
    assert "dp_shard 8" in out and "estimated peak per rank" in out
    total = float(out.rsplit("estimated peak per rank:", 1)[1].split()[0])
    assert 20 < total < 80, out  # a sane per-GPU figure for 8B FSDP 8 (not a measurement)
    assert GIB == 2**30
