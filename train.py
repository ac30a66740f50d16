"""Pretrain a Llama from a TOML JobConfig.

    python train.py --job.config_file debug_model.toml --training.steps 100
    torchrun --nproc_per_node=8 train.py --job.config_file llama_8b.toml

`Trainer` resolves the job (titanlite/job.py: every check of what a user can get wrong, the
layout, the tokenizer and model args), builds the model (titanlite/build.py) and every other piece
from its own config section, and `Trainer.train` runs the schedule. One step:
    microbatches -> count the step's target tokens (one all-reduce, which also carries the stop
    votes) -> per microbatch: forward, loss sum x (1 / step tokens), backward at once -> clip by
    the global norm -> read "finite?" and "stop?" (the step's one host sync) -> optimizer step.
"""

import contextlib
import logging
import os
import sys
import time
from functools import partial
from typing import NamedTuple

import torch

from titanlite.bad_steps import NonFiniteError, on_nonfinite, skips_loss_spike
from titanlite.build import build_model, count_params, init_model
from titanlite.checkpoint import CheckpointError, CheckpointManager, plan_load
from titanlite.checkpoint.seed import write_seed_checkpoint
from titanlite.checkpoint.storage import checkpoint_folder
from titanlite.checks import check_options, check_single_process
from titanlite.config import ConfigError, JobConfig
from titanlite.config_parse import (
    QUICK_START_NOTE,
    dump_toml,
    parse_args,
    with_quick_start_config,
)
from titanlite.data.loader import (
    build_source_validation_loaders,
    build_train_loader,
    build_validation_loader,
)
from titanlite.distributed import (
    CollectiveTimeouts,
    PeerFailure,
    block_names,
    clip_by_total_,
    destroy,
    dist_sum,
    grad_square_sums,
    init_distributed,
    local_value,
    params_by_block,
    peers_watched,
    to_device,
    world_sum,
)
from titanlite.dry_run import dry_run
from titanlite.eval.downstream import build_downstream
from titanlite.eval.validation import Validator
from titanlite.float8 import float8_after_optimizer_step, float8_enabled
from titanlite.hf_export import write_export_files
from titanlite.host import GarbageCollection
from titanlite.job import World, resolve_job
from titanlite.loss import IGNORE_INDEX
from titanlite.metrics import (
    DeviceMemoryMonitor,
    LogWindow,
    MetricsLogger,
    compute_throughput,
    default_expandable_segments,
    get_peak_flops,
    init_logger,
)
from titanlite.metrics_sinks import SampleIdLog
from titanlite.models import get_family
from titanlite.optim import build_lr_scheduler, build_optimizer, maybe_step_in_backward
from titanlite.parallel_dims import loss_parallel_ctx
from titanlite.plan.run import prediction
from titanlite.precision import apply_tf32, resolve_param_dtype
from titanlite.preemption import Preemption
from titanlite.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from titanlite.rehearsal import rehearse
from titanlite.shared_storage import check_job_folders_shared
from titanlite.source_loss import StepSources, source_losses
from titanlite.straggler import SlowRankFinder, local_numel, synchronize
from titanlite.train_state import TrainState

logger = logging.getLogger("titanlite")


def forward_backward(model, microbatches, loss_scale, *, chunk_tokens=0, sync_only_last=False,
                     context=contextlib.nullcontext, sources=None) -> torch.Tensor:  # fmt: skip
    """Backpropagate each microbatch at once (its activations are freed before the next), its
    summed loss times `loss_scale` = 1 / the step's target tokens over every microbatch and every
    data-parallel rank: the gradients are those of the step's mean loss, with no pass over them
    afterwards. Returns this rank's summed loss over its microbatches (detached); with a
    mixture's `sources` (StepSources), [1 + n]: that sum, then its per-source sums."""
    loss_sum = torch.zeros(() if sources is None else 1 + sources.n, device=loss_scale.device)
    for i, (tokens, labels) in enumerate(microbatches):
        if sync_only_last:  # FSDP reduce-scatters only after the last microbatch's backward
            model.set_requires_gradient_sync(i == len(microbatches) - 1)
        by = {} if sources is None else {"row_sources": sources.rows[i]}
        with context():
            out = model(tokens, labels, chunk_tokens=chunk_tokens, **by)
            mb_loss = local_value(out[0] if by else out)
            (mb_loss * loss_scale).backward()
        mb_loss = mb_loss.detach()
        loss_sum += torch.cat([mb_loss[None], out[1]]) if by else mb_loss
    return loss_sum


def pipeline_forward_backward(model, microbatches, loss_scale, *, chunk_tokens=0,
                              context=contextlib.nullcontext, sources=None,
                              **_) -> torch.Tensor:  # fmt: skip
    """forward_backward through the pipeline: each microbatch is one schedule step, which splits
    it into pipeline microbatches and scales each one's summed loss by `loss_scale` (0 is
    returned on ranks without the last stage; with `sources`, [1 + n] as forward_backward's)."""
    loss_sum = torch.zeros(() if sources is None else 1 + sources.n, device=loss_scale.device)
    for i, (tokens, labels) in enumerate(microbatches):
        by = {} if sources is None else {"row_sources": sources.rows[i]}
        with context():
            loss_sum += model.forward_backward(tokens, labels, loss_scale, chunk_tokens, **by)
    model.reduce_tied_grads()
    return loss_sum


def count_step_tokens(microbatches, counts: bool, stop_vote: bool, device, by_source=None):
    """(target tokens of the whole step, number of ranks asking to stop, and with `by_source`
    (this rank's tokens per source) the step's per source, else None), from one all-reduce
    over every rank and without a host sync. Ranks whose labels a peer already counts (TP peers
    hold the same labels) pass counts=False. int64: exact at any batch size."""
    zero = torch.zeros((), dtype=torch.int64)
    local = sum(((labels != IGNORE_INDEX).sum() for _, labels in microbatches), zero)
    votes = torch.stack([local if counts else zero, torch.tensor(int(stop_vote))])
    if by_source is not None:
        votes = torch.cat([votes, by_source if counts else torch.zeros_like(by_source)])
    votes = world_sum(to_device(votes, device))
    return votes[0], votes[1], None if by_source is None else votes[2:]


class StepResult(NamedTuple):
    loss_sum: torch.Tensor  # this rank's summed loss (device); a mixture's: [1 + per source]
    tokens: torch.Tensor  # the step's target tokens over all dp ranks (device)
    grad_norm: torch.Tensor
    block_norms: torch.Tensor | None  # per block_names(), on log steps with log_layer_grad_norms
    lr: float  # the learning rate this step used
    stop: bool  # some rank was asked to stop: every rank saves and exits after this step
    data_seconds: float
    seconds: float
    optimizer_seconds: float | None  # on log steps (device-synced), when the optimizer ran here
    source_tokens: torch.Tensor | None = None  # a mixture's: the step's tokens per source (device)


class Every:
    """Due every `freq` steps and at the last step (and at step 1 with `first`), when enabled."""

    def __init__(self, freq: int, last: int, first: bool = False, enabled: bool = True):
        self.freq, self.last, self.first, self.enabled = freq, last, first, enabled

    def due(self, step: int) -> bool:
        hit = step % self.freq == 0 or step == self.last or (self.first and step == 1)
        return self.enabled and hit


class Trainer:
    """Resolves the job, builds every piece from its config section, resumes, and runs the loop."""

    def __init__(self, cfg: JobConfig, dist_env):
        self.rank, _, self.world_size, self.device = dist_env
        job = self._resolve_job(cfg)
        cfg = self.cfg  # under parallelism.plan auto, the planner's
        check_job_folders_shared(cfg)
        # Before anything slow: a checkpoint that is not there fails in seconds, at any scale.
        load_plan = plan_load(cfg.checkpoint, cfg.job.dump_folder)
        self.parallel_dims.build_mesh(self.device.type)
        val_loaders = self._build_data(job)
        # No weights are drawn that the checkpoint would overwrite (hours at 405B).
        self._build_model(job, draw_weights=load_plan is None)
        self._build_services(*val_loaders)
        folder = checkpoint_folder(cfg.job.dump_folder, cfg.checkpoint.folder)
        self._build_metrics(resuming=load_plan is not None and load_plan.path.parent == folder)
        self._resume(load_plan)

    def _resolve_job(self, cfg: JobConfig):
        """Every check, before anything is built, and the job's objects (the layout if planned
        here: self.cfg is then the planner's config)."""
        job = resolve_job(cfg, World(self.world_size, self.device))
        self.cfg = cfg = job.config
        # Loads the tasks (their check) before anything is built.
        downstream_schedule = Every(cfg.eval.freq, cfg.training.steps, enabled=bool(cfg.eval.tasks))
        self.downstream = build_downstream(cfg, job.pipeline, downstream_schedule)
        self.parallel_dims = job.parallel_dims
        self.model_args, self.global_batch_size = job.model_args, job.global_batch_size
        # Logged with the first step's metrics, so that plan --calibrate can set it beside them.
        self.prediction = prediction(job, self.device)
        return job

    def _build_data(self, job):
        """The training loader and its sample-id log; returns the validation loader (or None)
        and a mixture's per-source ones ({name: loader})."""
        cfg, t, pd = self.cfg, self.cfg.training, self.parallel_dims
        ranks = dict(dp_rank=pd.dp_rank, dp_degree=pd.dp_degree)
        vocab = self.model_args.vocab_size
        self.tokenizer = job.tokenizer  # an HF export writes its files
        self.loader = build_train_loader(
            t, job.tokenizer, **ranks, global_batch_size=self.global_batch_size,
            num_microbatches=job.num_microbatches, vocab_size=vocab, seed=cfg.debug.seed,
            validation=cfg.validation,
        )  # fmt: skip
        self.sample_ids = SampleIdLog(
            cfg.debug.log_sample_ids, cfg.job.dump_folder, self.rank == self.log_rank, self.loader
        )
        if not cfg.validation.enable:
            return None, {}
        per_source = build_source_validation_loaders(
            t, cfg.validation, job.tokenizer, **ranks, vocab_size=vocab
        )
        if t.mixture and not cfg.validation.dataset_path:  # its sources' own (checked) only
            return None, per_source
        val = build_validation_loader(t, cfg.validation, job.tokenizer, **ranks, vocab_size=vocab)
        return val, per_source

    def _build_model(self, job, draw_weights: bool):
        """The parallelized model on this device, its optimizer and LR schedule."""
        cfg, t, pd = self.cfg, self.cfg.training, self.parallel_dims
        self.compute_dtype = resolve_param_dtype(t.mixed_precision_param, self.device)
        apply_tf32(t.allow_tf32, self.device)
        # FSDP can skip the reduce-scatter of all but the last microbatch (more memory).
        self.sync_only_last = t.accumulation_sync == "last" and pd.fsdp_enabled
        self.model = build_model(
            cfg, self.model_args, pd, self.compute_dtype, self.device, job.pipeline
        )
        self.forward_backward = forward_backward if job.pipeline is None else (
            pipeline_forward_backward
        )  # fmt: skip
        init_model(cfg, self.model, self.device, draw_weights=draw_weights)
        logger.info(
            "model %s %s: %s parameters, vocab %d, world %d %s, compute %s",
            cfg.model.name, cfg.model.flavor, f"{count_params(cfg, self.model_args, False):,}",
            self.model_args.vocab_size, self.world_size, pd, self.compute_dtype,
        )  # fmt: skip
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.after_optimizer_step = float8_after_optimizer_step(cfg)
        self.step_in_backward = maybe_step_in_backward(
            self.optimizer, cfg.optimizer, t.max_norm, self.device
        )
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)

    def _build_services(self, val_loader, source_val_loaders):
        """What the loop asks each step: checkpoints, collective timeouts, preemption and
        validation."""
        cfg, steps = self.cfg, self.cfg.training.steps
        self.state = TrainState()
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, cfg.job.dump_folder, self.model, self.optimizer, self.scheduler,
            self.loader, self.state, dp_degree=self.parallel_dims.dp_degree, last_step=steps,
            n_layers=self.model_args.n_layers, complete_export=partial(
                write_export_files, tokenizer=self.tokenizer,
                tokenizer_path=cfg.model.tokenizer_path, max_len=cfg.training.seq_len,
            ),
        )  # fmt: skip
        self.timeouts = CollectiveTimeouts(cfg.comm, keep=(self.checkpointer.process_group,))
        self.preemption = Preemption()
        validates = val_loader is not None or bool(source_val_loaders)
        val_schedule = Every(cfg.validation.freq, steps, enabled=validates)
        self.validator = Validator(
            val_loader, cfg.validation, val_schedule, self.model_context, self.parallel_dims,
            self.device, source_val_loaders,
        )  # fmt: skip

    def _build_metrics(self, resuming: bool):
        """Loggers, the memory monitor, the slow-rank finder and the FLOP counts behind MFU;
        `resuming` its own checkpoint, the run continues its W&B run."""
        cfg, m = self.cfg, self.cfg.metrics
        self.log_schedule = Every(m.log_freq, cfg.training.steps, first=True)
        self.block_names = None
        if m.log_layer_grad_norms:
            self.block_names = block_names(self.model_args.n_layers)
        self.metrics = MetricsLogger(
            m, cfg.job.dump_folder, self.rank, self.log_rank, run_config=cfg.to_dict(),
            resuming=resuming,
        )  # fmt: skip
        self.memory = DeviceMemoryMonitor(self.device)
        self.slow_ranks = SlowRankFinder(
            self.world_size, self.device, m.slow_rank_threshold_pct, m.slow_rank_patience,
            local_numel(self.model), warns=self.rank == self.log_rank,
        )  # fmt: skip
        self.peak_flops = get_peak_flops(
            self.device, self.compute_dtype, m.peak_tflops, float8_enabled(cfg)
        )
        self.flops_per_token = get_family(cfg.model.name).flops_per_token(
            count_params(cfg, self.model_args, exclude_embedding=True), self.model_args,
            cfg.training.seq_len,
        )  # fmt: skip

    def _resume(self, load_plan):
        try:
            self.checkpointer.load(load_plan)
        except BaseException:
            self.close(exit_code=1)
            raise
        # Float8 scales precomputed after each optimizer step are not saved: compute them for
        # the loaded weights, or a resumed step would cast with other scales than the run did.
        self.after_optimizer_step(self.model)

    @property
    def log_rank(self) -> int:
        return int(os.environ.get("LOG_RANK", 0))

    def model_context(self):
        """Around every forward and backward (CE backward on vocab-sharded logits needs it too)."""
        return loss_parallel_ctx(self.parallel_dims.loss_parallel(self.cfg.parallelism))

    # ------------------------------------------------------------------ the schedule
    def train(self) -> int:
        cfg, st = self.cfg, self.state
        last = cfg.training.steps
        self.preemption.install()
        logger.info("training from step %d to %d", st.step, last)
        first = st.step
        window = LogWindow()
        prof_cfg, folder = cfg.profiling, cfg.job.dump_folder
        with (
            GarbageCollection(cfg.training.gc_freq) as garbage,
            maybe_enable_profiling(prof_cfg, folder, st.step, self.rank) as profiler,
            maybe_enable_memory_snapshot(prof_cfg, folder, st.step, self.rank) as snapshotter,
        ):
            while st.step < last:
                with peers_watched(st.step + 1, cfg.comm.train_timeout_seconds):
                    out = self.train_step(log=self.log_schedule.due(st.step + 1))
                st.step += 1
                self.sample_ids.write(st.step)
                if st.step == first + 1:  # start-up is over: from now on a silent rank is a fault
                    self.timeouts.training()
                st.tokens_seen += self.global_batch_size * cfg.training.seq_len
                st.elapsed_s += out.seconds
                window.add(out)
                profiler.step()
                snapshotter.step()
                garbage.step(st.step)
                values = {}
                if self.log_schedule.due(st.step) or out.stop:
                    values.update(self.train_metrics(window))
                    window = LogWindow()
                if self.validator.due(st.step):
                    values.update(self.validator.run(self.model, cfg.loss.chunk_tokens))
                if self.downstream.due(st.step):
                    values.update(self.downstream.run(self.model, self.tokenizer,
                                                      self.model_context))  # fmt: skip
                if values:
                    self.metrics.log(st.step, values)
                if self.checkpointer.due(st.step, final=st.step == last or out.stop):
                    with self.timeouts.saving(st.step):
                        self.checkpointer.save(st.step)
                if out.stop:
                    logger.warning("stop requested by signal: saved step %d, exiting", st.step)
                    break
        self.checkpointer.wait()  # an async save's failure surfaces here, as a sync one's would
        return 0

    def train_step(self, log: bool = False) -> StepResult:
        """One optimizer step; `log`: the step will be logged, so its block grad norms are
        measured if asked (a pass over the parameter names; the norm's reductions then carry
        one value per block instead of one in all)."""
        t0 = time.perf_counter()
        microbatches = self.loader.next_step()
        t_data = time.perf_counter() - t0
        counts, device = self.parallel_dims.counts_step_tokens, self.device
        sources = self.loader.step_sources()  # a mixture's: each row's source (loss/<name>)
        if sources is not None:
            n = len(self.loader.source_names())
            sources = StepSources(sources, microbatches, n, device)
        tokens, stop_votes, source_tokens = count_step_tokens(
            microbatches, counts, self.preemption.requested, device,
            None if sources is None else sources.tokens,
        )  # fmt: skip
        microbatches = [(to_device(x, device), to_device(y, device)) for x, y in microbatches]
        if self.step_in_backward is not None:  # backward steps the weights a save may be copying
            self.checkpointer.wait_for_staging()
        loss_sum = self.forward_backward(
            self.model, microbatches, 1.0 / tokens, chunk_tokens=self.cfg.loss.chunk_tokens,
            sync_only_last=self.sync_only_last, context=self.model_context, sources=sources,
        )  # fmt: skip
        all_sums, loss_sum = loss_sum, loss_sum if sources is None else loss_sum[0]
        grad_norm, block_norms = self.clip_gradients(by_block=log and self.block_names is not None)
        # The step's one host sync. A NaN/inf anywhere makes the global norm non-finite on every
        # rank, so all ranks take the same branch and bad weights are never stepped into (or,
        # stepped in backward, never trained on or saved). CPU offload: the norm is on the CPU.
        flags = [grad_norm.isfinite().to(device, non_blocking=True), stop_votes > 0]
        if self.cfg.training.loss_spike_factor > 0:  # the global loss, read in the same sync
            loss = dist_sum(loss_sum, self.parallel_dims.loss_mesh) / tokens
            flags = [f.to(loss.dtype) for f in flags] + [loss]
        finite, stop, *loss = torch.stack(flags).tolist()
        # A rehearsal's values are meaningless (fake collectives): every step takes its update,
        # whose time and optimizer state it measures, and a NaN never stops it.
        finite = finite or self.cfg.comm.mode == "fake_backend"
        self.checkpointer.wait_for_staging()  # an async save's copy, overlapping fwd/bwd, is done
        spike = finite and loss and skips_loss_spike(loss[0], self.state, self.cfg, self.loader)
        t_optimizer, optimizer_seconds = time.perf_counter(), None
        if finite and not spike:
            self.optimizer.step()  # after a step in backward no gradient is left: a no-op
            self.after_optimizer_step(self.model)
            if log and self.step_in_backward is None:  # timed for SlowRankFinder
                synchronize(device)
                optimizer_seconds = time.perf_counter() - t_optimizer
        elif not finite:
            loss = dist_sum(loss_sum, self.parallel_dims.loss_mesh) / tokens
            early = self.step_in_backward is not None
            on_nonfinite(loss.item(), grad_norm.item(), self.state, self.cfg, early)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        return StepResult(
            all_sums, tokens, grad_norm, block_norms, lr, stop, t_data, seconds, optimizer_seconds,
            source_tokens,
        )  # fmt: skip

    def clip_gradients(self, by_block: bool):
        """Clip to training.max_norm by the global norm; returns it, and with `by_block` each
        block's norm too (else None)."""
        if self.step_in_backward is not None:  # every parameter was stepped in backward
            return self.step_in_backward.grad_norm(), None  # the hooks summed the norm
        params = list(self.model.parameters())
        groups = params_by_block(self.model, self.block_names) if by_block else [params]
        # One computation for both: the global norm is the root of the blocks' squares.
        squares = grad_square_sums(groups, self.parallel_dims.pp_mesh)
        grad_norm = clip_by_total_(params, self.cfg.training.max_norm, squares.sum().sqrt())
        return grad_norm, squares.sqrt().float() if by_block else None

    def train_metrics(self, window: LogWindow) -> dict:
        """The last step's loss and grad norm (and its blocks' grad norms when measured);
        throughput and data time averaged over the window; peak memory since the previous log
        line."""
        out = window.last
        tokens_per_device = self.global_batch_size * self.cfg.training.seq_len / self.world_size
        values = compute_throughput(
            tokens_per_device * window.steps, window.seconds, self.flops_per_token, self.peak_flops
        )
        # A mixture's per-source sums reduced with the loss, in the same all-reduce.
        sums = dist_sum(out.loss_sum, self.parallel_dims.loss_mesh)
        if out.source_tokens is not None:
            names = self.loader.source_names()
            values.update(source_losses(names, sums[1:], out.source_tokens))  # loss/<name>
            sums = sums[0]
        values.update(
            loss=sums / out.tokens,
            grad_norm=out.grad_norm,
            lr=out.lr,
            **self.memory.log_values(),
            data_time_pct=100 * window.data_seconds / window.seconds,
            elapsed_s=self.state.elapsed_s,
            tokens_seen=self.state.tokens_seen,
        )
        values.update(self.prediction)
        self.prediction = {}
        values.update(self.loader.source_tokens())  # a mixture's tokens_seen/<name>
        if (skipped := self.loader.skipped_rows()) is not None:  # training.dataset_max_bad_rows
            values["data/skipped_rows"] = skipped
        step_s, data_s = window.seconds / window.steps, window.data_seconds / window.steps
        values.update(self.slow_ranks.report(step_s, data_s, out.optimizer_seconds))
        if out.block_norms is not None:  # one read for them all
            norms = out.block_norms.tolist()
            values.update({f"grad_norm/{n}": v for n, v in zip(self.block_names, norms)})
        self.memory.reset_peak_stats()
        return values

    def close(self, exit_code: int = 0):
        """Finish an in-flight async save, flush the logs (a nonzero `exit_code` marks the W&B
        run failed), stop the prefetch threads."""
        self.checkpointer.close()
        self.metrics.close(exit_code)
        self.sample_ids.close()
        self.loader.close()


def say_error(e: Exception):
    """One line on stderr for a user mistake, in one write: under torchrun every rank shares
    the pipe, and print()'s separate write of the newline lets two ranks' lines run together."""
    sys.stderr.write(f"titanlite: error: {e}\n")


def start_process(cfg: JobConfig):
    """This process's device and process group, its logger and its RNG, as the job asks."""
    default_expandable_segments(os.environ, torch.cuda.is_available())
    dist_env = init_distributed(cfg.training.enable_cpu_offload, cfg.comm.init_timeout_seconds)
    init_logger(dist_env[0], int(os.environ.get("LOG_RANK", 0)))
    torch.manual_seed(cfg.debug.seed)
    if cfg.debug.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=cfg.debug.deterministic_warn_only)
    return dist_env


def main(argv=None) -> int:
    try:
        argv, quick_start = with_quick_start_config(sys.argv[1:] if argv is None else argv)
        cfg = parse_args(argv)
        check_options(cfg)  # before the process group: a mistake costs no start-up
        check_single_process(cfg)
    except ConfigError as e:
        say_error(e)
        return 2
    if quick_start and os.environ.get("RANK", "0") == "0":
        print(QUICK_START_NOTE, flush=True)
    if cfg.comm.mode == "fake_backend" or cfg.checkpoint.create_seed_checkpoint:
        init_logger(0, 0)
        job = dry_run if cfg.comm.mode == "fake_backend" else write_seed_checkpoint
        if cfg.comm.fake_steps:
            job = partial(rehearse, trainer_cls=Trainer)
        try:
            return job(cfg)
        except ConfigError as e:
            say_error(e)
            return 2
    dist_env = start_process(cfg)
    rank = dist_env[0]
    try:
        trainer = Trainer(cfg, dist_env)
    except (ConfigError, CheckpointError) as e:
        # User mistakes (config, data, checkpoint), found before any step: one line, no
        # traceback wall, from every rank that met it. Not from rank 0 alone: a mistake may be
        # one node's (a file only its disk lacks), and where all ranks meet it torchrun stops
        # the rest as soon as the first exits, maybe before rank 0 has written its line.
        say_error(e)
        destroy(barrier=False)
        return 2
    cfg = trainer.cfg  # under parallelism.plan auto, the planner's
    if rank == 0:
        dump_toml(cfg, os.path.join(cfg.job.dump_folder, "config.toml"))
    if cfg.job.print_config:
        logger.info("config:\n%s", cfg.to_dict())
    try:
        code = trainer.train()
    except NonFiniteError as e:  # raised on every rank alike: the global norm is shared
        logger.error("%s", e)
        code = 3
    except CheckpointError as e:  # a save failed on every rank alike (disk full, ...)
        if rank == 0:
            logger.error("%s", e)
        code = 5
    except PeerFailure as e:  # its peers are gone or hang: no teardown that waits on them
        logger.error("%s", e)
        destroy(barrier=False)
        return 4
    except ConfigError as e:
        # Bad data that a rank met while training (its share of a stream): said by the ranks
        # that read it; the others wait in a collective until torchrun stops them.
        say_error(e)
        destroy(barrier=False)
        return 2
    # Only on exits every rank takes together: teardown has barriers that a crashed peer would
    # hang; after an unexpected error the process just dies and torchrun stops the others.
    trainer.close(code)
    del trainer  # unreachable, so destroy() frees its process groups while Python is whole
    destroy()
    return code


if __name__ == "__main__":
    sys.exit(main())
