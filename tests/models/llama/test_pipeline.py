"""Pipeline planning (pipeline_plan.py, pure Python: stage split, schedules, microbatches, bad
inputs) and stage cutting on the meta device. The schedules' numerics are proven end to end in
tests/integration/test_pipeline_numerics.py."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from titanlite.models.decoder.model import Transformer
from titanlite.models.decoder.pipeline import PipelinedModel, cut_stage
from titanlite.models.llama.args import get_model_args
from titanlite.models.pipeline_plan import plan_pipeline, split_layers

TORCH_2_13 = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


def options(schedule="1F1B", layers_per_stage=0, first=1, last=1, microbatch_size=1, csv=""):
    return SimpleNamespace(
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_schedule_csv=str(csv),
        pipeline_parallel_layers_per_stage=layers_per_stage,
        pipeline_parallel_first_stage_less_layers=first,
        pipeline_parallel_last_stage_less_layers=last,
        pipeline_parallel_microbatch_size=microbatch_size,
    )


def layers(plan):
    return [list(r) for r in plan.stage_layers]


def test_default_split_counts_embedding_and_output_as_layers():
    # The debug model (6 layers) on PP 2: 8 units, 4 a stage; the ends give one each away.
    plan = plan_pipeline(6, 2, 2, options())
    assert layers(plan) == [[0, 1, 2], [3, 4, 5]] and plan.stages_per_rank == 1
    assert plan.microbatches == 2 and plan.stage_ids(1, 2) == [1]
    # Multi-stage schedules default to two stages a rank: 8 units over 4 stages.
    plan = plan_pipeline(6, 2, 4, options("interleaved1f1b"))  # names are case-insensitive
    assert plan.schedule == "Interleaved1F1B"
    assert layers(plan) == [[0], [1, 2], [3, 4], [5]]
    assert plan.stage_ids(0, 2) == [0, 2] and plan.stage_ids(1, 2) == [1, 3]
    # V-shaped: rank 0 holds the first and the last stage.
    plan = plan_pipeline(6, 2, 4, options("ZBVZeroBubble"))
    assert plan.stage_ids(0, 2) == [0, 3] and plan.stage_ids(1, 2) == [1, 2]


def test_uneven_split_and_layers_per_stage():
    # 126 layers + 2 over 16 stages: 8 units each; the ends hold 7 layers.
    sizes = [len(r) for r in split_layers(126, 16, 1, 1)]
    assert sizes == [7] + [8] * 14 + [7] and sum(sizes) == 126
    assert [len(r) for r in split_layers(7, 2, 0, 0)] == [4, 3]  # earlier stages take the rest
    plan = plan_pipeline(126, 8, 16, options("Interleaved1F1B", layers_per_stage=4))
    assert plan.num_stages == 32 and plan.stages_per_rank == 4
    assert [len(r) for r in plan.stage_layers][:2] == [3, 4]


@pytest.mark.parametrize(
    "args,match",
    [
        ((6, 2, 2, options("Pipedream")), "'Pipedream' is not a known schedule; choose one of"),
        ((6, 2, 2, options(layers_per_stage=1)), "1F1B runs one stage per rank, but the split"),
        (
            (6, 2, 2, options(layers_per_stage=3)),
            "make 3 stages, not a multiple of pipeline_parallel_degree 2",
        ),
        ((6, 2, 4, options("ZBVZeroBubble", 1)), "ZBVZeroBubble needs exactly 2 stages per rank"),
        ((6, 2, 4, options("Interleaved1F1B", 4)), "needs at least 2 stages per rank, but the"),
        ((1, 4, 4, options()), r"1 layers cannot be split into 4 pipeline stages"),
        ((6, 2, 3, options(microbatch_size=2)), r"local_batch_size \(3\) must be a multiple"),
        ((6, 4, 2, options()), r"1F1B over 4 stages needs at least 4 microbatches per step, but"),
        ((6, 2, 3, options("ZBVZeroBubble")), r"over 4 stages needs at least 4 microbatches"),
        ((6, 2, 6, options("Interleaved1F1B", microbatch_size=2)), "needs a multiple of 2 micro"),
        (
            (6, 2, 4, options("PipelineScheduleMulti")),
            "PipelineScheduleMulti runs a schedule read from a file: set "
            "parallelism.pipeline_parallel_schedule_csv",
        ),
    ],
)
def test_bad_plans_name_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        plan_pipeline(*args)


def test_gpipe_allows_fewer_microbatches_than_stages():
    assert plan_pipeline(6, 4, 2, options("GPipe")).microbatches == 2


def test_stages_keep_the_whole_models_names_and_run_in_sequence():
    args = get_model_args("debugmodel", vocab_size=256, max_seq_len=16)
    with torch.device("meta"):
        meta = Transformer(args)
    plan = plan_pipeline(args.n_layers, 2, 2, options())
    stages = [cut_stage(meta, plan.stage_layers[i], i == 0, i == 1) for i in range(2)]
    names = [set(dict(s.named_parameters())) for s in stages]
    assert names[0].isdisjoint(names[1]) and names[0] | names[1] == set(
        dict(meta.named_parameters())
    )
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[1]
    assert "layers.3.attention.wq.weight" in names[1]

    whole = Transformer(args)
    whole.init_weights(seed=0)
    for stage in stages:
        stage.to_empty(device="cpu")
        stage.load_state_dict(whole.state_dict(), strict=False)
        stage.init_buffers()
    tokens = torch.randint(0, 256, (2, 16))
    labels = torch.randint(0, 256, (2, 16))
    hidden = stages[0](tokens, labels)
    assert hidden.shape == (2, 16, args.dim)  # a stage without the head returns hidden states
    torch.testing.assert_close(stages[1](hidden, labels), whole(tokens, labels), rtol=0, atol=0)


@pytest.mark.parametrize(
    "name, per_rank, rank1_stages",
    [("PipelineScheduleMulti", 2, [1, 3]), ("pipelineschedulesingle", 1, [1])],
)
def test_torchtitans_csv_schedule_names_place_the_stages(name, per_rank, rank1_stages, tmp_path):
    """torchtitan names a schedule file's run by torch's base class: Multi places two stages a
    rank, looped (as Interleaved1F1B), Single one (as 1F1B); the file then runs."""
    csv = tmp_path / "schedule.csv"
    if per_rank == 2:
        csv.write_text("0F0,2F0,0F1,2F1,2B0,0B0,2B1,0B1\n1F0,3F0,1F1,3F1,3B0,1B0,3B1,1B1\n")
    else:
        csv.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    plan = plan_pipeline(6, 2, 2, options(name, csv=csv))
    assert (plan.stages_per_rank, plan.num_stages, plan.csv) == (per_rank, 2 * per_rank, str(csv))
    assert plan.stage_ids(1, 2) == rank1_stages


# A schedule file's order for both stages on one rank: split backwards (I, then W) as in the
# zero-bubble schedules, microbatch 1's forward overlapped with microbatch 0's backward input.
ONE_RANK_CSV = "0F0,1F0,1I0,(0F1;0I0)OVERLAP_F_B,1F1,1I1,0I1,1W0,0W0,1W1,0W1\n"


@pytest.mark.parametrize(
    "schedule, csv",
    [("InterleavedZeroBubble", ""), ("ZBVZeroBubble", ""), ("DualPipeV", ""),
     ("Interleaved1F1B", ONE_RANK_CSV), ("PipelineScheduleMulti", ONE_RANK_CSV)],
)  # fmt: skip
def test_zero_bubble_schedules_on_one_rank_match_the_whole_model(schedule, csv, tmp_path):
    """Both stages on one rank (a one-rank group), the chunked loss on. What torch 2.11 needs
    there: no int among a stage's inputs (its zero-bubble backward looks up a grad_fn for each),
    and no warm-up send from a rank to itself (gloo has none). The same holds for a schedule
    read from a file (torch's _PipelineScheduleRuntime). Run forward only (validation), each
    gives the same loss."""
    args = get_model_args("debugmodel", vocab_size=64, max_seq_len=16, n_layers=2, dim=32)
    whole = Transformer(args)
    whole.init_weights(seed=0)
    if csv:
        (tmp_path / "schedule.csv").write_text(csv)
        csv = tmp_path / "schedule.csv"
    plan = plan_pipeline(args.n_layers, 1, 2, options(schedule, first=0, last=0, csv=csv))
    assert plan.csv == (str(csv) if csv else "")
    stages = [cut_stage(whole, plan.stage_layers[i], i == 0, i == 1) for i in range(2)]
    chunks = []
    chunked = stages[1].chunked_loss
    stages[1].chunked_loss = lambda *a, **kw: chunks.append(a[-1]) or chunked(*a, **kw)
    tokens, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = PipelinedModel(stages, [0, 1], plan, init_device_mesh("cpu", (1,)), "cpu")
        assert (type(model.schedule).__name__ == "_PipelineScheduleRuntime") == bool(csv)
        loss = model.forward_backward(tokens, labels, loss_scale=0.5, chunk_tokens=5)
        with torch.no_grad():
            validation_loss = model(tokens, labels)  # the schedule forward only
        # A mixture's rows (row 0 from source 2, row 1 from source 0): per-source sums after the
        # loss; scale 0 adds nothing to the gradients compared below.
        # Not on torch 2.11: its zero-bubble weight backward reads a legacy attribute of the
        # per-source loss's autograd node and raises (a known gap, not silent).
        rows = F.one_hot(torch.tensor([2, 0]), 3).float()
        if TORCH_2_13:
            sums = model.forward_backward(tokens, labels, 0.0, chunk_tokens=5, row_sources=rows)
    finally:
        dist.destroy_process_group()
    if TORCH_2_13:
        with torch.no_grad():
            row_losses = [whole(tokens[i : i + 1], labels[i : i + 1]) for i in range(2)]
        torch.testing.assert_close(sums, torch.stack([sum(row_losses), row_losses[1], 0 * loss,
                                                      row_losses[0]]))  # fmt: skip
    expected = whole(tokens, labels)
    (expected * 0.5).backward()
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(validation_loss, expected.detach())
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.keys() == dict(whole.named_parameters()).keys()
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    assert set(chunks) == {5}  # every last-stage forward used the chunked loss


def test_importing_the_trainer_and_planners_does_not_import_the_pipeline_runtime():
    """torch.distributed.pipelining's import loads torch._dynamo (~0.5 s here): train.py's
    import (with the registered families) and the planning code must not load it."""
    code = (
        "import sys, train, titanlite.plan.perf, titanlite.memory_estimate; "
        "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.pipelining', "
        "'torch._dynamo'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
