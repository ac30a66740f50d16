"""Memory estimator arithmetic on small hand-checkable cases (no timings, no GPU)."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import REPO, TINY_TRAIN, torchrun_script
from script_runner import measured_estimate

from titanlite import memory_estimate
from titanlite.build import model_args_for_vocab
from titanlite.config_parse import parse_args
from titanlite.memory_estimate import (
    CUDA_CACHED_FRACTION,
    GIB,
    MemorySetup,
    activation_bytes,
    block_activation_elems,
    estimate,
    estimate_stages,
    fsdp_buffer_bytes,
    fsdp_grad_bytes,
    loss_bytes,
    mask_bias_bytes,
    param_counts,
)
from titanlite.models.llama.args import ModelArgs
from titanlite.plan.perf import Layout
from titanlite.plan.shape import memory_setup, setup_from_config

# dim 64, 2 layers, 4 heads (head_dim 16), ffn 256 (multiple_of 256), vocab 128.
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32)


def setup(**kw) -> MemorySetup:
    base = dict(model_args=ARGS, local_batch_size=2, seq_len=16, device="cuda")
    return MemorySetup(**{**base, **kw})


def test_param_counts_by_hand():
    c = param_counts(ARGS)
    assert c["block_split"] == 4 * 64 * 64 + 3 * 64 * 256  # wq wk wv wo, w1 w2 w3
    assert c["block_replicated"] == 2 * 64  # its two norms
    assert c["embedding"] == c["output"] == 128 * 64 and c["norm"] == 64
    block = c["block_split"] + c["block_replicated"]
    assert c["total"] == 2 * block + 2 * 128 * 64 + 64


def test_fsdp_splits_params_grads_and_states_1_over_n():
    one = estimate(setup()).rows
    four = estimate(setup(dp_shard=4, accumulation=2)).rows  # grads held at the peak
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
    split = 2 * c["block_split"] + c["embedding"] + c["output"]
    replicated = 2 * c["block_replicated"] + c["norm"]
    assert rows["params (fp32, sharded)"] == pytest.approx((split / 2 + replicated) * 4)


def test_tp_divides_activations_except_gathered_norm_outputs():
    tokens, dim, ffn = 32, 64, 256
    fp32 = dict(param_dtype="float32")
    # Per token and block: norm inputs and rstds; norm outputs (gathered under SP); q, k, v,
    # SDPA's output and its 4 heads' logsumexp; the FFN's four.
    full_1 = (2 * dim + 2) + 2 * dim + (4 * dim + 4 + 4 * ffn)
    full_2 = (2 * dim + 2) / 2 + 2 * dim + (4 * dim + 4 + 4 * ffn) / 2
    # 2 blocks saved + the FFN backward's two gradients, [tokens, ffn / tp], fp32.
    assert activation_bytes(setup(**fp32)) == pytest.approx(tokens * (2 * full_1 + 2 * ffn) * 4)
    assert activation_bytes(setup(tp=2, **fp32)) == pytest.approx(tokens * (2 * full_2 + ffn) * 4)


def test_cp_splits_tokens_and_shards_params_over_dp_shard_x_cp():
    """CP 2: half of each sequence per rank, the whole sequence's K and V (kv_dim 64 x 2 per
    local token) saved by attention instead of repeated local ones, the late chunk's mask."""
    tokens, dim, ffn, kv = 32 // 2, 64, 256, 64
    fp32 = dict(param_dtype="float32")
    # Per local token: as without CP, but wo's input is a copy of the two chunks' outputs.
    full = (2 * dim + 2) + 2 * dim + 3 * dim + 2 * kv * 2 + 4 + 4 * ffn
    # Each of the 2 blocks keeps its two chunks' fp32 biases, [4, 4] + [4, 16] on rank 0; the
    # bools of one call, the largest, [4, 16], exist while it runs.
    mask = 2 * (4 * 4 + 4 * 16) * 4 + 4 * 16
    saved = tokens * (2 * full + 2 * ffn) * 4  # 2 blocks + the FFN backward's gradients
    assert activation_bytes(setup(cp=2, **fp32)) == pytest.approx(saved + mask)
    rows = estimate(setup(cp=2, dp_shard=2)).rows
    assert rows["params (fp32, sharded)"] == pytest.approx(param_counts(ARGS)["total"] * 4 / 4)
    assert loss_bytes(setup(cp=2)) == loss_bytes(setup(seq_len=8))


def test_gqa_kv_saved_as_kv_heads_unless_a_mask_repeats_them():
    """SDPA keeps k and v with their 2 kv heads (kv_dim 32) under a plain causal mask, repeated
    to the 4 query heads (dim 64) under a dense document mask and on CPU; under CP 2 the early
    and late chunks' repeated keys, 2.5 per local token (one gathered copy, 2, under MHA)."""
    gqa = replace(ARGS, n_kv_heads=2)
    docs = replace(gqa, document_masking=True, bos_id=1, eos_id=2)

    def sdpa_kv(args, cp=1, device="cuda"):
        elems = block_activation_elems(setup(model_args=args, cp=cp, device=device))[0]
        # bf16: norm inputs and fp32 rstds, norm outputs, q, SDPA's output (and under CP wo's
        # input apart), 4 heads' fp32 logsumexp, the FFN's four.
        norms = 2 * 64 + 2 * 2
        outputs = 64 * (2 if cp > 1 else 1)
        return elems - norms - 2 * 64 - 64 - outputs - 4 * 2 - 4 * 256

    assert sdpa_kv(gqa) == 2 * 32
    assert sdpa_kv(gqa, device="cpu") == 2 * 64
    assert sdpa_kv(docs) == 2 * 64
    assert sdpa_kv(replace(docs, attention_backend="flex")) == 2 * 32
    assert sdpa_kv(gqa, cp=2) == 2 * 64 * 2.5
    assert sdpa_kv(ARGS, cp=2) == 2 * 64 * 2


def test_selective_op_options_save_all_or_every_second_matmul_output():
    """Llama 3 8B's block per token, by hand: the block input, the SDPA output and the matmul
    outputs q 4096, k 1024, v 1024, wo 4096, w1 14336, w3 14336, w2 4096; 'op_alternate'
    recomputes k, wo and w3 (torchtitan's 'op', whose 31,744 its docs use)."""
    eight_b = ModelArgs(dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, vocab_size=128256,
                        ffn_dim_multiplier=1.3, multiple_of=1024, max_seq_len=8192)  # fmt: skip

    def saved(option):
        return block_activation_elems(setup(model_args=eight_b, selective_ac_option=option))[1]

    assert saved("op") == 4096 + 4096 + (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)
    assert saved("op") == 51_200
    assert saved("op_alternate") == 51_200 - 1024 - 4096 - 14336 == 31_744


def test_compiled_blocks_save_less_and_free_as_their_backward_goes():
    """Llama 3 8B's block per token, by hand, compiled: no AC keeps the two norm outputs, q, k,
    v, the SDPA output, wo's input, w1's and w3's outputs and their gated product (not the norm
    inputs, nor silu's output); selective AC drops w2's output, which no gradient reads. Full
    AC keeps the block inputs and rebuilds one block, with no block of gradient buffers."""
    eight_b = ModelArgs(dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, vocab_size=128256,
                        ffn_dim_multiplier=1.3, multiple_of=1024, max_seq_len=8192)  # fmt: skip
    c = setup(model_args=eight_b, compiled=True, local_batch_size=1, seq_len=8192)
    full, sac, ckpt = block_activation_elems(c)
    assert full == 5 * 4096 + 2 * 1024 + 3 * 14336 == 65_536
    assert sac == 51_200 - 4096
    assert block_activation_elems(replace(c, selective_ac_option="op_alternate"))[1] == 27_648
    assert activation_bytes(replace(c, ac_mode="full")) == 8192 * (4 * 4096 + 65_536) * 2


SAVED_BY = {"none": "inductor", "op": "partition", "op_alternate": "partition"}


@pytest.mark.slow  # inductor's C++ build of one block's forward, ~25 s of CPU uncached
@pytest.mark.parametrize("option", list(SAVED_BY))
def test_compiled_block_saves_what_the_estimate_counts(option, monkeypatch):
    """A compiled block (GQA: 4 query over 2 kv heads) saves, per token, the bf16 elements
    block_activation_elems counts for it (the block input excepted: the caller holds it). The
    un-checkpointed block compiles with inductor; the selective ones through the same min-cut
    partitioner without inductor's C++ build (their saved sets are the same: checked with
    inductor on torch 2.13)."""
    import functools

    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.compilers import nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    import titanlite.models.decoder.model as model_module
    from titanlite.models import kernels
    from titanlite.models.decoder.parallelize import apply_ac, apply_compile

    monkeypatch.setattr(kernels, "native_gqa", lambda device: True)  # as on a GPU
    args = replace(ARGS, n_kv_heads=2, n_layers=1)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": model_module.TransformerBlock(args)})
    holder.to(torch.bfloat16)
    if option != "none":
        apply_ac(holder, "selective", option)
    backend = SAVED_BY[option]
    if backend == "partition":
        partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
        backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition,
                               decompositions=select_decomp_table())  # fmt: skip
    apply_compile(holder, backend, compile_loss=False)
    x = torch.randn(1, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    rope = model_module.precompute_rope_cache(args)[:16]
    params = {p.data_ptr() for p in holder.parameters()}
    saved = {}

    def pack(t):
        if t.dtype == torch.bfloat16 and t.data_ptr() not in params | {x.data_ptr()}:
            saved[t.untyped_storage().data_ptr()] = t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        holder.layers["0"](x, rope)  # the forward saves them; its backward need not compile
    s = setup(model_args=args, compiled=True, selective_ac_option=option, seq_len=16)
    full, sac, ckpt = block_activation_elems(s)
    assert sum(saved.values()) == 16 * (full if option == "none" else sac - ckpt)


def test_the_compiled_plain_loss_holds_the_logits_and_their_gradient():
    eager = loss_bytes(setup())
    compiled = loss_bytes(setup(compiled_loss=True))
    tokens, vocab = 2 * 16, 128  # setup(): local batch 2 x seq 16, ARGS' vocab
    assert eager == tokens * vocab * (3 * 4 + 2)  # bf16 logits, their fp32 upcast, ...
    assert compiled == tokens * vocab * (2 + 2)  # bf16 logits and their bf16 gradient
    # The plan of a compiled layout counts it unless the loss is vocab-parallel.
    assert memory_setup(ARGS, "llama3", 16, Layout(compile=True)).compiled_loss
    assert not memory_setup(ARGS, "llama3", 16, Layout(tp=2, compile=True)).compiled_loss
    assert not memory_setup(ARGS, "llama3", 16, Layout(compile=False)).compiled_loss


def test_a_dense_document_mask_is_held_per_microbatch_in_flight():
    """The sdpa backend's document mask: [rows, seq / cp, seq] bools kept from forward to
    backward, plus each block's fp32 bias of it (the whole mask without CP; the two chunks' rows
    under CP, where it replaces the causal chunk masks' bias); flex's block mask is not counted."""
    fp32 = dict(param_dtype="float32")
    docs = replace(ARGS, document_masking=True, bos_id=1, eos_id=2)

    def extra(args, cp=1):
        return activation_bytes(setup(model_args=args, cp=cp, **fp32)) - activation_bytes(
            setup(
                model_args=replace(args, document_masking=False, attention_backend="sdpa"),
                cp=cp,
                **fp32,
            )
        )

    # 2 rows x 16 x 16 bools + both blocks' 2 x 16 x 16 fp32 bias; SDPA's repeated K/V (GQA
    # only) aside. Under CP 2 the chunks' rows, [4, 4] + [4, 16] a row, instead of the causal
    # chunks' biases and the bools of one call, [4, 16].
    assert extra(docs) == 2 * 16 * 16 + 2 * (2 * 16 * 16 * 4)
    chunks = 4 * 4 + 4 * 16
    causal = 2 * (chunks * 4) + 4 * 16
    assert extra(docs, cp=2) == 2 * 8 * 16 + 2 * (2 * chunks * 4) - causal
    assert extra(replace(docs, attention_backend="flex")) == 0


def test_a_mask_bias_is_kept_by_every_block_that_keeps_its_saved_tensors(monkeypatch):
    """Without AC every block keeps its mask's bias, per microbatch; selective 'op' and full AC
    recompute it, so only the block rebuilt in backward holds one; selective '2' keeps it in
    every block it does not checkpoint, and the rebuilt one."""
    big = replace(ARGS, n_layers=4)
    # Under CP 2, [4, 4] + [4, 16] on rank 0, broadcast over the rows; bf16.
    assert mask_bias_bytes(setup(model_args=big, cp=2)) == (4 * 4 + 4 * 16) * 2
    assert mask_bias_bytes(setup(model_args=big)) == 0  # plain causal attention takes no mask

    def biases(**kw):
        s = setup(model_args=big, cp=2, **kw)
        with_bias = activation_bytes(s)
        monkeypatch.setattr(memory_estimate, "mask_bias_bytes", lambda s: 0.0)
        without = activation_bytes(s)
        monkeypatch.undo()
        return (with_bias - without) / mask_bias_bytes(s)

    assert biases(ac_mode="none") == 4
    assert biases(ac_mode="full") == biases(ac_mode="selective") == 1
    assert biases(ac_mode="selective", selective_ac_option="2") == 2 + 1


def test_norms_keep_the_same_on_cpu_as_on_a_gpu():
    """model.RMSNorm keeps its input and rstd on CPU, as CUDA's fused kernel does; what else
    differs on CPU (SDPA's repeated K and V) is absent without GQA."""
    for dtype in ("float32", "bfloat16"):
        cpu, gpu = setup(device="cpu", param_dtype=dtype), setup(param_dtype=dtype)
        assert block_activation_elems(cpu) == block_activation_elems(gpu)


def test_activation_checkpointing_reduces_activations():
    big = replace(ARGS, n_layers=8)
    none = activation_bytes(setup(model_args=big))
    sel = activation_bytes(setup(model_args=big, ac_mode="selective"))
    every2 = activation_bytes(setup(model_args=big, ac_mode="selective", selective_ac_option="2"))
    full = activation_bytes(setup(model_args=big, ac_mode="full"))
    full32 = activation_bytes(setup(model_args=big, ac_mode="full", param_dtype="float32"))
    assert full < sel < none
    assert full < every2 < none
    # Full AC, eager: 8 block inputs (dim each) + one rebuilt block + its FFN's 2 gradients.
    per_block = (2 * 64 + 2) + 2 * 64 + (4 * 64 + 4 + 4 * 256)
    assert full32 == pytest.approx(32 * (8 * 64 + per_block + 2 * 256) * 4)


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
    kept = ("unsharded weights / grads", "activations (AC none)", "logits / loss")
    for dp_shard in (1, 2):  # one rank too: FSDP then wraps the model just to offload it
        fp32 = setup(dp_shard=dp_shard, param_dtype="float32")
        offloaded = estimate(replace(fp32, cpu_offload=True)).rows
        for key in ("params (fp32, sharded)", "grads (fp32, sharded)", "AdamW states (2 x fp32)"):
            assert offloaded[key] == 0
        assert offloaded[kept[0]] > 0
        if dp_shard == 2:
            assert [offloaded[k] for k in kept] == [estimate(fp32).rows[k] for k in kept]
    cfg = parse_args(["--training.enable_cpu_offload"])
    assert setup_from_config(cfg, 2, model_args_for_vocab(cfg, 128)).cpu_offload


def test_cuda_estimate_is_the_allocator_figure_the_log_reports():
    """The live peak plus what the caching allocator keeps of the smaller peak's working set:
    what it reserves (train.py's memory_gib), with nothing added for the CUDA context or NCCL,
    which live outside the allocator. On CPU (peak RSS) nothing is cached."""
    s = setup(dp_shard=2)
    est = estimate(s)
    local = param_counts(ARGS)["total"] / 2
    working = fsdp_buffer_bytes(param_counts(ARGS), s) + activation_bytes(s) + loss_bytes(s)
    assert est.peak == "start of backward" and working > local * 8
    cache = est.rows["allocator cache (freed, kept)"]
    assert cache == pytest.approx(CUDA_CACHED_FRACTION * local * 8)  # the step's grads + temps
    assert est.total - cache == pytest.approx(local * 12 + working)
    assert "allocator cache (freed, kept)" not in estimate(replace(s, device="cpu")).rows


def test_the_peak_is_the_start_of_backward_or_the_optimizer_step():
    """train.py zeroes gradients with set_to_none: a step's first backward starts without them,
    a later microbatch of gradient accumulation with all of them. Where the working set is
    smaller than the gradients plus the optimizer's temporaries, the step's end is the peak."""
    local = param_counts(ARGS)["total"] / 2
    s = setup(dp_shard=2)
    assert estimate(s).rows["grads (fp32, sharded)"] == 0
    accumulating = estimate(replace(s, accumulation=4))
    assert accumulating.rows["grads (fp32, sharded)"] == local * 4
    assert accumulating.total - estimate(s).total == pytest.approx(local * 4)
    small = estimate(replace(s, local_batch_size=1, seq_len=1))
    assert small.peak == "optimizer step"
    assert small.rows["grads (fp32, sharded)"] == small.rows["optimizer-step temporaries"]
    assert small.rows["optimizer-step temporaries"] == local * 4


def test_bad_setup_is_a_value_error():
    with pytest.raises(ValueError, match="ac_mode"):
        setup(ac_mode="sometimes")
    with pytest.raises(ValueError, match="selective_ac_option"):
        setup(ac_mode="selective", selective_ac_option="x")


@pytest.mark.slow  # trains 2 steps of the debug model under torch's MemTracker
def test_measure_sets_the_estimate_beside_the_live_tensors_peak():
    """`--measure` on this CPU, an eager fp32 run without AC: the estimate is within 5% of the
    peak bytes of live tensors (each block's saved set, measured to the byte above, plus its
    FFN backward's two gradients); the RSS peak is above both (glibc keeps freed memory)."""
    out = measured_estimate("debug_model.toml")
    measured = {}
    for line in out.splitlines():
        if line.startswith("measured "):  # "measured WHAT: X GiB; estimate Y GiB (+E%)"
            what, rest = line.removeprefix("measured ").split(": ", 1)
            measured[what] = float(rest.split()[0])
            estimated = float(rest.split("estimate ")[1].split()[0])
    live, rss = measured["peak of live tensors"], measured["peak RSS above baseline"]
    assert abs(estimated / live - 1) < 0.05 and rss > max(live, estimated), out


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


def pp_setup(schedule="1F1B", **kw) -> MemorySetup:
    options = parse_args(["--parallelism.pipeline_parallel_schedule", schedule]).parallelism
    return setup(pp=2, pp_options=options, param_dtype="float32", **kw)


def test_pp_ranks_hold_their_stages_and_the_ends_the_root_parts():
    """ARGS' 2 layers on PP 2: one block a stage; the embedding on rank 0, the final norm,
    output and logits on rank 1; activations of min(microbatches, pp - rank) microbatches
    of 1 row (1F1B) or all of them (GPipe)."""
    c = param_counts(ARGS)
    block = c["block_split"] + c["block_replicated"]
    first, last = (replace(pp_setup(), pp_rank=r) for r in (0, 1))
    assert estimate(first).rows["params (fp32, sharded)"] == (block + c["embedding"]) * 4
    assert estimate(last).rows["params (fp32, sharded)"] == (block + c["output"] + c["norm"]) * 4
    assert loss_bytes(first) == 0 and loss_bytes(last) > 0
    tokens, (full, _, _) = 16, block_activation_elems(first)
    per_mb = tokens * full * 4  # one block of one 1-row microbatch, fp32
    grads = tokens * 2 * 256 * 4  # the FFN backward's two [tokens, ffn] gradients
    assert activation_bytes(first) == pytest.approx(per_mb * 2 + grads)  # 2 in flight
    assert activation_bytes(last) == pytest.approx(per_mb * 1 + grads)
    gpipe = replace(pp_setup("GPipe", local_batch_size=4), pp_rank=1)
    assert activation_bytes(gpipe) == pytest.approx(per_mb * 4 + grads)


def test_a_tied_outputs_last_stage_holds_a_copy_of_the_embedding():
    tied = replace(ARGS, tie_embeddings=True)
    c = param_counts(tied)
    block = c["block_split"] + c["block_replicated"]
    assert c["output"] == 0
    first, last = (replace(pp_setup(), model_args=tied, pp_rank=r) for r in (0, 1))
    assert estimate(first).rows["params (fp32, sharded)"] == (block + c["embedding"]) * 4
    assert estimate(last).rows["params (fp32, sharded)"] == (block + c["embedding"] + c["norm"]) * 4
    one = setup(model_args=tied, param_dtype="float32")
    assert estimate(one).rows["params (fp32, sharded)"] == c["total"] * 4  # held once


def test_pp_fsdp_holds_the_stage_gradient_in_fp32_until_the_last_microbatch():
    """torch's pipeline stage syncs FSDP's gradients once, after the last microbatch: the
    stage's whole unsharded gradient accumulates in fp32, beside the bf16 gradients not yet
    upcast: the head's through the whole backward, then one block's or (made last) the
    embedding's, whichever is larger."""
    c = param_counts(ARGS)
    block, head = c["block_split"] + c["block_replicated"], c["output"] + c["norm"]
    first, last = (replace(pp_setup(), param_dtype="bfloat16", pp_rank=r) for r in (0, 1))
    assert (
        fsdp_grad_bytes(c, first) == (block + c["embedding"]) * 4 + max(block, c["embedding"]) * 2
    )
    assert fsdp_grad_bytes(c, last) == (block + head) * 4 + (head + block) * 2
    fp32 = replace(pp_setup(dp_shard=2), pp_rank=0)  # FSDP without a cast: fp32 gradients only
    assert fsdp_grad_bytes(c, fp32) == (block + c["embedding"]) * 4
    assert fsdp_grad_bytes(c, setup(dp_shard=2)) == block * 4  # no PP: one block's, synced


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fsdp_grad_bytes_is_what_fsdp_holds_under_pp(dtype, tmp_path):
    """PP 2 x FSDP 2, each step two local batches of two 1-row pipeline microbatches: each
    rank's peak of FSDP's unsharded gradients, read from FSDP itself, is the estimator's figure
    for that rank, to the byte (unsharded, so no padding)."""
    pp = ["--parallelism.pipeline_parallel_degree", "2"]
    args = [*TINY_TRAIN, *pp, "--training.steps", "2", "--training.mixed_precision_param", dtype,
            "--job.dump_folder", str(tmp_path)]  # fmt: skip
    proc = torchrun_script(REPO / "tests" / "support" / "fsdp_grad_peak.py", *args, nproc=4)
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3], proc.stdout
    for r in ranks:
        assert r["measured"] == r["estimated"], r


@pytest.mark.slow  # launches the worker, on 2 ranks for TP and CP
@pytest.mark.parametrize("dim, n", [("tp", 1), ("tp", 2), ("cp", 2), ("doc", 1)])
def test_an_eager_block_saves_what_the_estimate_counts(dim, n):
    """Two eager blocks (GQA, 2 rows of 16 tokens) on this CPU, bf16 and fp32, plain, under TP 2
    with sequence parallel, under CP 2 and with a dense document mask: the bytes autograd saves
    for their backward, read through saved-tensor hooks, are the estimator's figure per block
    (the mask's bias among them), to the byte (tests/support/block_saved_bytes.py)."""
    proc = torchrun_script(REPO / "tests" / "support" / "block_saved_bytes.py", dim, nproc=n)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    assert len(rows) == 2 * n, proc.stdout
    for row in rows:
        assert row["measured"] == row["estimated"], row


def test_pp_estimates_every_stage_of_the_405b_config():
    cfg = parse_args(["--job.config_file", "llama_405b.toml",
                      "--parallelism.pipeline_parallel_degree", "8",
                      "--training.local_batch_size", "8",
                      "--activation_checkpoint.mode", "full"])  # fmt: skip
    args = model_args_for_vocab(cfg, 128256)
    stages = estimate_stages(setup_from_config(cfg, 512, args))
    assert len(stages) == 8
    flat = estimate(setup_from_config(cfg, 512, args, rank=0))
    assert flat.total == stages[0].total  # global rank 0 is on pipeline rank 0
    params = sum(e.rows["params (fp32, sharded)"] for e in stages) * 8 * 8  # x dp_shard x tp
    assert params == pytest.approx(stages[0].num_params * 4, rel=0.02)  # norms replicate over tp
    # 1F1B: the first stage keeps the most microbatches in flight.
    acts = [e.rows["activations (AC full)"] for e in stages]
    assert acts == sorted(acts, reverse=True) and acts[0] > 2 * acts[-1]


def test_muon_keeps_one_momentum_buffer_per_matrix_element():
    """Muon's states against the optimizer's own kinds of the model's parameters: 4 bytes per
    hidden-matrix element, AdamW's 8 for the rest, sharded as the parameters; its step holds
    one whole matrix (the largest: w1, 256 x 64) however the matrices are sharded."""
    import torch

    from titanlite.models import get_family
    from titanlite.optim.groups import param_kinds

    with torch.device("meta"):
        model = get_family("llama3").model_cls(ARGS)
    kinds, sizes = param_kinds(model), dict(model.named_parameters())
    matrices = sum(sizes[n].numel() for n, k in kinds.items() if k == "matrix")
    rest = param_counts(ARGS)["total"] - matrices
    for dp in (1, 4):
        rows = estimate(setup(optimizer="Muon", dp_shard=dp)).rows
        assert "AdamW states (2 x fp32)" not in rows
        assert rows["Muon + AdamW states (1 x fp32 / 2 x fp32)"] == pytest.approx(
            (matrices * 4 + rest * 8) / dp
        )
    on_device = param_counts(ARGS)["total"] / 4
    _, _, step = memory_estimate.optimizer_bytes(
        param_counts(ARGS), setup(optimizer="Muon", dp_shard=4), on_device
    )
    assert step == pytest.approx(rest * 4 / 4 + 12 * 256 * 64 + 4 * 64**2)
    adam = estimate(setup(optimizer="Adam")).rows
    assert adam["Adam states (2 x fp32)"] == param_counts(ARGS)["total"] * 8


def test_the_config_and_the_planner_count_the_chosen_optimizer():
    from titanlite.job import World, resolve_job
    from titanlite.plan.search import memory_gib
    from titanlite.plan.shape import layout_of, model_of

    cfg = parse_args(["--optimizer.name", "Muon"])
    model = model_of(cfg, 2048)
    args = model_args_for_vocab(cfg, 2048)
    assert (
        "Muon + AdamW states (1 x fp32 / 2 x fp32)"
        in estimate(setup_from_config(cfg, 1, args)).rows
    )
    adamw = replace(model, optimizer="AdamW")
    lo = layout_of(resolve_job(cfg, World(1), 2048))
    assert memory_gib(model, lo) < memory_gib(adamw, lo)


def test_bf16_adamw_states_are_half():
    total = param_counts(ARGS)["total"]
    rows = estimate(setup(state_dtype="bfloat16")).rows
    assert rows["AdamW states (2 x bfloat16)"] == total * 4
    cfg = parse_args(["--optimizer.state_dtype", "bfloat16"])
    args = model_args_for_vocab(cfg, 2048)
    assert "AdamW states (2 x bfloat16)" in estimate(setup_from_config(cfg, 1, args)).rows
