"""Pipeline parallelism: the Llama cut into stages by layers, from outside the model, run by a
torch.distributed.pipelining schedule with the loss kept exact.

A stage is a copy of the meta-built Transformer that keeps only its layers (plus the embedding
on the first stage, the final norm, output and loss on the last): its parameter names are the
whole model's, so checkpoints do not depend on the layout. Each stage is then parallelized like
a whole model (TP, AC, compile, FSDP). The last stage returns each pipeline microbatch's summed
cross-entropy, and the schedule's loss function only multiplies it by 1 / (the step's target
tokens): the schedule runs with scale_grads=False, so the gradients are those of the step's
mean loss with no pass over them. Which layers each stage holds is planned in pipeline_plan.py.

A tied output (the output projection by the embedding's weight) keeps a copy of that weight on
the last stage, under the same name: its gradient is summed with the first stage's once a step
(reduce_tied_grads), so the two copies, drawn alike, step alike.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    get_schedule_class,
)
from torch.distributed.tensor import DTensor, Shard

from titanlite.distributed import local_value
from titanlite.models.pipeline_plan import PipelinePlan
from titanlite.torch_compat import csv_schedule, pipeline_stage_base


def cut_stages(model: nn.Module, plan: PipelinePlan, pp_mesh: DeviceMesh, tp_mesh=None):
    """(stage ids, stage modules) of this pipeline rank, cut from the meta `model`."""
    ids = plan.stage_ids(pp_mesh.get_local_rank(), pp_mesh.size())
    stages = []
    for i in ids:
        first, last = i == 0, i == plan.num_stages - 1
        stage = cut_stage(model, plan.stage_layers[i], first, last)
        if tp_mesh is not None:
            keep_tp_boundaries_local(stage, tp_mesh, first, last)
        stages.append(stage)
    return ids, stages


def cut_stage(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """A copy of the (meta) model holding only `layers`, the embedding if `first`, the final
    norm and output if `last`. Names stay the whole model's ("layers.7.attention.wq")."""
    stage = copy.deepcopy(model)
    for key in list(stage.layers.keys()):
        if int(key) not in layers:
            del stage.layers[key]
    if not first and not (last and model.args.tie_embeddings):
        # (A tied output reads the embedding's weight: the last stage keeps its own copy.)
        stage.tok_embeddings = None
    if not last:
        stage.norm = stage.output = None
    return stage


def keep_tp_boundaries_local(stage: nn.Module, tp_mesh: DeviceMesh, first: bool, last: bool):
    """Under TP the residual stream is a sequence-sharded DTensor; between stages it travels as
    the local shard (plain tensors, which every pipelining version sends) and is re-wrapped on
    arrival."""
    if not first:
        stage.register_forward_pre_hook(
            lambda _, args: (DTensor.from_local(args[0], tp_mesh, [Shard(1)]), *args[1:])
        )
    if not last:
        stage.register_forward_hook(
            lambda _, __, out: out.to_local() if isinstance(out, DTensor) else out
        )


def loss_as_vector(_module, _args, loss_sum):
    """The last stage's output, a microbatch's summed loss, as a plain [1] tensor: the schedule
    concatenates its outputs, which a 0-d tensor (or a replicated DTensor under loss parallel)
    cannot be; `return_outputs=False`, which skips that, is missing from older torch. With a
    mixture's row sources the output is (sum, per-source sums [n]): then a [1 + n] tensor."""
    loss_sum, by_source = loss_sum if isinstance(loss_sum, tuple) else (loss_sum, None)
    local = loss_sum.to_local() if isinstance(loss_sum, DTensor) else loss_sum
    return local.reshape(1) if by_source is None else torch.cat([local.reshape(1), by_source])


class ScaledLoss:
    """The schedule's loss function: the last stage's output is a microbatch's summed loss; it
    is kept, and returned times `scale`."""

    def __init__(self):
        self.scale = 1.0
        self.sums: list[torch.Tensor] = []

    def __call__(self, loss_sum, _target):
        self.sums.append(loss_sum.detach())
        return loss_sum[0] * self.scale  # [1 + n] with a mixture's per-source sums after it

    def take(self, microbatches: int) -> torch.Tensor | None:
        """The summed loss of the last `microbatches` calls (the first step also infers the
        stages' shapes with a forward whose loss is not a microbatch's), or None; with per-source
        sums, the [1 + n] vector of their sums."""
        sums, self.sums = self.sums[-microbatches:], []
        if not sums:
            return None
        return torch.cat(sums).sum() if len(sums[0]) == 1 else torch.stack(sums).sum(0)


class _Stage(pipeline_stage_base()):
    """A PipelineStage whose connection warm-up skips this rank itself (see torch_compat), and
    whose forward-only runs pass no gradients between its stages (below)."""

    # Forward only (validation), torch's schedule runtime still walks a schedule's backward
    # actions, which do nothing then, but on a V-shaped schedule it hands their gradients from
    # one stage of a rank to the other, which raises without a backward: there is nothing to hand.
    def get_local_bwd_output(self, mb_index):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


class PipelinedModel(nn.Module):
    """This rank's stages as one model for the optimizer, checkpoints, clipping and init: it
    holds their submodules under the whole model's names (tok_embeddings, layers.N, norm,
    output), so state-dict keys do not depend on the layout. Training runs `forward_backward`;
    calling it runs the schedule forward only (validation)."""

    def __init__(
        self, stages, stage_ids, plan: PipelinePlan, pp_mesh: DeviceMesh, device, tied_group=None
    ):
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            for name, child in stage.named_children():
                if name == "layers":
                    self.layers.update(child)
                else:
                    setattr(self, name, child)
        self._stages = stages  # a plain list: not submodules, so names stay the whole model's
        self.args = stages[0].args
        # A tied output's weight is the embedding's on the first stage and a copy on the last:
        # `tied_group` holds the ranks of both (None: no tie between stages on this rank).
        self.tied_group = tied_group
        self._tied = [self.tok_embeddings.weight] if tied_group is not None else []
        if tied_group is not None and 0 not in stage_ids:
            self._tied[0].counted_on_another_stage = True  # the grad norm counts it once
        self.has_first, self.microbatches = 0 in stage_ids, plan.microbatches
        group = pp_mesh.get_group()
        self.chunk_tokens = 0
        for stage, i in zip(stages, stage_ids):
            if i == plan.num_stages - 1:
                stage.register_forward_pre_hook(self._pass_chunk_tokens, with_kwargs=True)
                stage.register_forward_hook(loss_as_vector)
        pipeline_stages = [_Stage(m, i, plan.num_stages, device, group=group)
                           for m, i in zip(stages, stage_ids)]  # fmt: skip
        self.loss = ScaledLoss()
        if plan.csv:  # checked by plan_pipeline; torch adds the sends and receives
            self.schedule = csv_schedule(pipeline_stages, plan.microbatches, self.loss, plan.csv)
        else:
            cls = get_schedule_class(plan.schedule)
            multi = issubclass(cls, PipelineScheduleMulti)
            self.schedule = cls(
                pipeline_stages if multi else pipeline_stages[0], plan.microbatches,
                loss_fn=self.loss, scale_grads=False,
            )  # fmt: skip
        self.device = device

    def reduce_tied_grads(self) -> None:
        """After the step's last backward: the tied weight's gradient summed over its copies on
        the first and last stage (the embedding's part and the output's), so both step alike
        from the same initial weights and stay equal."""
        for weight in self._tied:
            grad = weight.grad
            if isinstance(grad, DTensor) and grad.placements != weight.placements:
                # TP's embedding lookup leaves a replicated gradient of its vocab-sharded weight
                # (the output's is sharded): each copy takes its own shard first.
                grad = weight.grad = grad.redistribute(weight.device_mesh, weight.placements)
            dist.all_reduce(local_value(grad), group=self.tied_group)

    def param_init(self, name: str):
        return self._stages[0].param_init(name)

    def init_buffers(self, device=None):
        for stage in self._stages:
            stage.init_buffers(device)

    def reshard(self):
        for stage in self._stages:
            if hasattr(stage, "reshard"):
                stage.reshard()

    def _pass_chunk_tokens(self, _stage, args, kwargs):
        """chunk_tokens reaches the last stage here, not through the schedule: torch 2.11's
        zero-bubble backward looks up a grad_fn for every stage input, and an int has none."""
        return args, {**kwargs, "chunk_tokens": self.chunk_tokens}

    def _run(self, run, tokens, labels, chunk_tokens, row_sources=None) -> torch.Tensor:
        inputs = (tokens,) if self.has_first else ()
        self.chunk_tokens = chunk_tokens
        # Every stage is given the microbatch's labels (the last for its loss, context
        # parallelism for the sequence length) and its document ids: a later stage's hidden
        # states cannot tell where documents end.
        documents = self._stages[0].documents(tokens)
        masks = {} if documents is None else {"documents": documents}
        if row_sources is not None:  # split into pipeline microbatches with the rows
            masks["row_sources"] = row_sources
        run(*inputs, target=labels, labels=labels, **masks)
        loss_sum = self.loss.take(self.microbatches)
        if loss_sum is None:  # no last stage here
            shape = () if row_sources is None else (1 + row_sources.shape[1],)
            return torch.zeros(shape, device=self.device)
        return loss_sum

    def forward_backward(self, tokens, labels, loss_scale, chunk_tokens=0, row_sources=None):
        """One accumulation microbatch through the schedule, every pipeline microbatch's summed
        loss times `loss_scale`; returns this rank's summed loss (0 without the last stage), with
        `row_sources` ([b, n] one-hot) a [1 + n] tensor: the sum, then the per-source sums."""
        self.loss.scale = loss_scale
        return self._run(self.schedule.step, tokens, labels, chunk_tokens, row_sources)

    def forward(self, tokens, labels, chunk_tokens=0) -> torch.Tensor:
        return self._run(self.schedule.eval, tokens, labels, chunk_tokens)


def tied_group(world_mesh: DeviceMesh, pp_mesh: DeviceMesh):
    """The process group of this rank and its peer at the other end of a tied output: the
    ranks of the first stage (pipeline rank 0) and of the last (pipeline rank pp - 1, except
    in V-shaped schedules, which checks.py refuses with a tie) that share this rank's other
    mesh coordinates; None on a rank holding neither. Every rank calls it (it may make groups)."""
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    if pp == 2:  # the pipeline group is the pair
        return pp_mesh.get_group()
    ranks = world_mesh.mesh  # global ranks by (pp, dp_replicate, dp_shard, cp, tp)
    pairs = torch.stack([ranks[0].flatten(), ranks[-1].flatten()], dim=1).tolist()
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group if rank in (0, pp - 1) else None
