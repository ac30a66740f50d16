"""The step-time model on cases whose arithmetic can be checked by hand."""

from dataclasses import replace

import pytest

from titanlite.plan.devices import Device
from titanlite.plan.perf import Constants, Layout, Shape, pipeline_bubble, predict

# Round numbers: 1 TFLOP/s peak, 1 GB/s memory and links.
DEVICE = Device("unit", 80.0, 1.0, 2.0, 1.0, 1.0, 0.5)
UNIT = Constants(1.0, 1.0, 0.0, 0.0, 1.0, 2.0, 1.0)  # perfect efficiency, no elementwise time
SHAPE = Shape(dim=1000, ffn_dim=3000, n_layers=4, n_heads=10, head_dim=100, kv_dim=500,
              vocab=2000, block_linear_params=10**6, params_total=10**7, flops_per_token=1e8,
              seq_len=1000)  # fmt: skip


def test_one_gpu_step_is_matmuls_attention_head_and_optimizer():
    lo = Layout(local_batch_size=2, ac="none")  # 2 x 1000 tokens
    p = predict(SHAPE, lo, DEVICE, 8, UNIT)
    tokens = 2000
    matmul = 6 * 10**6 * tokens / 1e12  # per block
    attention = 7 * 1000 * 10 * 100 * tokens / 1e12  # per block
    head = 6 * 2000 * 1000 * tokens / 1e12
    optimizer = 10**7 * 28 / 1e9
    assert p.terms["block_matmul_s"] == pytest.approx(matmul)
    assert p.terms["block_attention_s"] == pytest.approx(attention)
    assert p.step_s == pytest.approx(4 * (matmul + attention) + head + optimizer)
    assert p.tokens_per_s_per_gpu == pytest.approx(tokens / p.step_s)
    assert p.mfu == pytest.approx(1e8 * p.tokens_per_s_per_gpu / 1e12)


def test_muon_step_is_its_traffic_and_a_world_share_of_newton_schulz():
    """SHAPE's block: wq, wo 1000 x 1000; wk, wv 500 x 1000; w1, w2, w3 3000 x 1000."""
    lo = Layout(dp_shard=2, local_batch_size=2, ac="none")
    adamw, muon = (predict(replace(SHAPE, optimizer=o), lo, DEVICE, 8, UNIT) for o in
                   ("AdamW", "Muon"))  # fmt: skip
    local, matrices = 10**7 / 2, 4 * 10**6 / 2
    traffic = (matrices * 20 + (local - matrices) * 28) / 1e9
    per_iter = (2 * (4 * 1000**3 + 2 * 1000**3) + 2 * (4 * 500**2 * 1000 + 2 * 500**3)
                + 3 * (4 * 1000**2 * 3000 + 2 * 1000**3))  # fmt: skip
    ns = 5 * per_iter * 4 / 2 / 1e12  # 4 blocks, 2 ranks
    assert adamw.split["optimizer"] == pytest.approx(local * 28 / 1e9)
    assert muon.split["optimizer"] == pytest.approx(traffic + ns)


def test_full_ac_recomputes_a_third_of_the_matmuls_and_two_sevenths_of_attention():
    none, full = (predict(SHAPE, Layout(ac=ac), DEVICE, 8, UNIT) for ac in ("none", "full"))
    t = none.terms
    added = 4 * (t["block_matmul_s"] / 3 + t["block_attention_s"] * 2 / 7)
    assert full.step_s - none.step_s == pytest.approx(added)
    assert full.split["recompute"] == pytest.approx(added)


def test_selective_alternate_also_recomputes_k_wo_and_w3():
    shape = replace(SHAPE, block_linear_params=2 * 1000 * 1000 + 2 * 1000 * 500 + 3 * 1000 * 3000)
    sel, alt = (predict(shape, Layout(ac=ac), DEVICE, 8, UNIT)
                for ac in ("selective", "selective_alternate"))  # fmt: skip
    forward = sel.terms["block_matmul_s"] / 3  # one block's forward matmuls
    k_wo_w3 = 1000 * (500 + 1000 + 3000) / shape.block_linear_params  # 4.5 M of 12 M
    added = 4 * forward * k_wo_w3
    assert alt.split["recompute"] - sel.split["recompute"] == pytest.approx(added)
    assert alt.step_s - sel.step_s == pytest.approx(added)


def test_chunked_loss_recomputes_the_logits():
    plain, chunked = (predict(SHAPE, Layout(chunk_tokens=c), DEVICE, 8, UNIT) for c in (0, 256))
    assert chunked.terms["head_s"] == pytest.approx(plain.terms["head_s"] * 8 / 6)


def test_tensor_parallel_splits_the_work_and_adds_its_collectives():
    lo = Layout(tp=2, ac="none")
    p = predict(SHAPE, lo, DEVICE, 8, UNIT)
    one = predict(SHAPE, Layout(ac="none"), DEVICE, 8, UNIT)
    assert p.terms["block_matmul_s"] == pytest.approx(one.terms["block_matmul_s"] / 2)
    # 8 collectives per block of a [1000, 1000] bf16 activation, half of it moved, at 1 GB/s.
    assert p.terms["block_tp_s"] == pytest.approx(8 * 1000 * 1000 * 2 / 2 / 1e9)


def test_a_group_larger_than_a_node_uses_the_network():
    inside = predict(SHAPE, Layout(dp_shard=8), DEVICE, 8, UNIT)
    across = predict(SHAPE, Layout(dp_shard=16), DEVICE, 8, UNIT)
    assert inside.terms["fsdp_link_gbps"] == 1.0 and across.terms["fsdp_link_gbps"] == 0.5


def test_fsdp_traffic_hides_under_compute_but_its_first_gather():
    p = predict(SHAPE, Layout(dp_shard=2, local_batch_size=4), DEVICE, 8, UNIT)
    gather = 10**6 * 2 / 2 / 1e9  # one block's bf16 weights, half gathered, 1 GB/s
    assert p.terms["first_gather_s"] == pytest.approx(gather)
    assert p.terms["dp_traffic_s"] < p.split["compute"]
    assert p.split["dp_comm_exposed"] == pytest.approx(gather)


def test_fsdp_traffic_beyond_compute_is_exposed():
    slow = Device("slow links", 80.0, 1.0, 2.0, 1.0, 1e-4, 1e-4)
    p = predict(SHAPE, Layout(dp_shard=2), slow, 8, UNIT)
    excess = p.terms["dp_traffic_s"] - p.split["compute"]
    assert excess > 0
    assert p.split["dp_comm_exposed"] == pytest.approx(excess + p.terms["first_gather_s"])


@pytest.mark.parametrize(
    "schedule, microbatches, bubble",
    [("1F1B", 8, 3 / 8), ("GPipe", 4, 3 / 4), ("Interleaved1F1B", 8, 3 / 16),
     ("ZBVZeroBubble", 8, 3 / 16 / 3)],
)  # fmt: skip
def test_pipeline_bubble(schedule, microbatches, bubble):
    assert pipeline_bubble(Layout(pp=4, schedule=schedule), microbatches) == pytest.approx(bubble)
    assert pipeline_bubble(Layout(pp=1), 8) == 0


def test_float8_speeds_up_the_block_matmuls_only():
    bf16, f8 = (predict(SHAPE, Layout(float8=f), DEVICE, 8, UNIT) for f in (False, True))
    assert f8.terms["block_matmul_s"] == pytest.approx(bf16.terms["block_matmul_s"] / 2)
    assert f8.terms["head_s"] == bf16.terms["head_s"]
