"""Pretrain a Llama from a TOML JobConfig.

    python train.py --job.config_file debug_model.toml --training.steps 100
    torchrun --nproc_per_node=8 train.py --job.config_file llama_8b.toml

This is the only file that sees the whole JobConfig: it builds each piece from its own config
section, then runs the loop. One step, as data:
    microbatches -> count target tokens (one all-reduce over dp) -> per microbatch: forward, loss
    sum x (1 / step tokens), backward at once -> clip by the global norm -> finite check ->
    optimizer + schedule step -> metrics every log_freq steps -> maybe checkpoint.
"""

import contextlib
import logging
import math
import os
import sys
import time

import torch

from titanlite.checkpoint import CheckpointManager
from titanlite.config import ConfigError, JobConfig, dump_toml, parse_args
from titanlite.data.loader import build_dataloader
from titanlite.data.tokenizer import build_tokenizer
from titanlite.distributed import clip_grad_norm_, destroy, dist_sum, init_distributed
from titanlite.metrics import (
    DeviceMemoryMonitor,
    MetricsLogger,
    get_peak_flops,
    init_logger,
    num_flops_per_token,
)
from titanlite.models.llama.args import get_model_args, pad_vocab
from titanlite.models.llama.model import Transformer
from titanlite.models.llama.parallelize import (
    init_weights_parallel,
    loss_parallel_ctx,
    parallelize_llama,
)
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel_dims import ParallelDims
from titanlite.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from titanlite.train_state import TrainState

logger = logging.getLogger("titanlite")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class NonFiniteError(RuntimeError):
    pass


def build_model(cfg: JobConfig, model_args, parallel_dims, mesh, device):
    """Meta build -> parallelize -> materialize on the device -> init: no rank holds the
    full unsharded model."""
    with torch.device("meta"):
        model = Transformer(model_args)
    num_params = model.num_params(exclude_embedding=True)
    parallelize_llama(
        model,
        parallel_dims,
        mesh,
        parallelism_cfg=cfg.parallelism,
        training_cfg=cfg.training,
        ac_cfg=cfg.activation_checkpoint,
        compile_cfg=cfg.compile,
    )
    model.to_empty(device=device)
    # Parallelism-invariant init: the same weights as a single-process run, whatever the layout.
    init_weights_parallel(model, model_args, cfg.training.seed, device)
    model.train()
    return model, num_params


def autocast_ctx(cfg: JobConfig, parallel_dims, device):
    """Without FSDP there is no MixedPrecisionPolicy, so bf16 compute comes from autocast."""
    dtype = DTYPES[cfg.training.mixed_precision_param]
    if parallel_dims.fsdp_enabled or dtype == torch.float32:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


class Trainer:
    """Holds the built pieces and runs the step; everything it needs comes from `setup`."""

    def __init__(self, cfg: JobConfig, dist_env):
        self.cfg = cfg
        self.rank, self.local_rank, self.world_size, self.device = dist_env
        t = cfg.training
        self.parallel_dims = ParallelDims(
            dp_replicate=cfg.parallelism.data_parallel_replicate_degree,
            dp_shard=cfg.parallelism.data_parallel_shard_degree,
            tp=cfg.parallelism.tensor_parallel_degree,
            world_size=self.world_size,
        )
        pd = self.parallel_dims
        if cfg.checkpoint.create_seed_checkpoint and self.world_size != 1:
            raise ConfigError(
                "checkpoint.create_seed_checkpoint runs in a single process: use plain "
                "`python train.py`, not torchrun; every layout can then load it"
            )
        self.tokenizer = build_tokenizer(cfg.model)
        self.model_args = get_model_args(
            cfg.model.flavor,
            vocab_size=pad_vocab(self.tokenizer.n_words),
            max_seq_len=t.seq_len,
            use_scaled_rope=cfg.model.use_scaled_rope,
        )
        pd.validate_model(self.model_args, cfg.parallelism)
        if t.global_batch_size < 0:
            t.global_batch_size = t.local_batch_size * pd.dp_degree
        if t.global_batch_size % (t.local_batch_size * pd.dp_degree):
            raise ConfigError(
                f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"training.local_batch_size ({t.local_batch_size}) x data-parallel degree "
                f"({pd.dp_degree}) = {t.local_batch_size * pd.dp_degree}"
            )
        self.mesh = pd.build_mesh(self.device.type)
        self.loader = build_dataloader(
            t, self.tokenizer, pd.dp_rank, pd.dp_degree, validation_cfg=cfg.validation
        )
        self.val_loader = (
            build_dataloader(
                t, self.tokenizer, pd.dp_rank, pd.dp_degree, "validation", cfg.validation
            )
            if cfg.validation.enable
            else None
        )

    def build(self):
        cfg = self.cfg
        self.model, num_params = build_model(
            cfg, self.model_args, self.parallel_dims, self.mesh, self.device
        )
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.state = TrainState()
        self.checkpointer = CheckpointManager(
            cfg.checkpoint,
            cfg.job.dump_folder,
            self.model,
            self.optimizer,
            self.scheduler,
            self.loader,
            self.state,
            dp_rank=self.parallel_dims.dp_rank,
            dp_degree=self.parallel_dims.dp_degree,
        )
        self.autocast = autocast_ctx(cfg, self.parallel_dims, self.device)
        self.loss_parallel = lambda: loss_parallel_ctx(cfg.parallelism.enable_loss_parallel)
        self.flops_per_token = num_flops_per_token(
            num_params, self.model_args, cfg.training.seq_len
        )
        self.peak_flops = get_peak_flops(
            self.device, DTYPES[cfg.training.mixed_precision_param], cfg.metrics.peak_tflops
        )
        self.memory = DeviceMemoryMonitor(self.device)
        self.metrics = MetricsLogger(cfg.metrics, cfg.job.dump_folder, enabled=self.is_log_rank)
        logger.info(
            "model %s %s: %s parameters (%s without the embedding), vocab %d, world %d %s",
            cfg.model.name,
            cfg.model.flavor,
            f"{num_params + self.model_args.vocab_size * self.model_args.dim:,}",
            f"{num_params:,}",
            self.model_args.vocab_size,
            self.world_size,
            self.parallel_dims,
        )

    @property
    def is_log_rank(self) -> bool:
        return self.rank == int(os.environ.get("LOG_RANK", 0))

    def forward_backward(self, microbatches) -> tuple[torch.Tensor, torch.Tensor]:
        """Backpropagate each microbatch at once; the loss is normalized by the step's target
        tokens over all microbatches and all data-parallel ranks, so no grad pass is needed."""
        dp_mesh = self.parallel_dims.dp_mesh
        local_tokens = sum((labels != -100).sum() for _, labels in microbatches)
        global_tokens = dist_sum(local_tokens.to(self.device, torch.float32), dp_mesh)
        scale = 1.0 / global_tokens  # stays on the device: no host sync per microbatch
        sync_last = self.cfg.training.accumulation_sync == "last"
        loss_sum = torch.zeros((), device=self.device)
        for i, (tokens, labels) in enumerate(microbatches):
            if sync_last and self.parallel_dims.fsdp_enabled:
                self.model.set_requires_gradient_sync(i == len(microbatches) - 1)
            tokens = tokens.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with self.loss_parallel(), self.autocast():
                mb_loss = self.model(tokens, labels, chunk_tokens=self.cfg.loss.chunk_tokens)
                mb_loss = _local(mb_loss)
                (mb_loss * scale).backward()
            loss_sum += mb_loss.detach()
        return loss_sum, global_tokens

    def train_step(self, microbatches) -> dict:
        loss_sum, global_tokens = self.forward_backward(microbatches)
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm)
        # One host sync per step. A NaN/inf anywhere makes the global norm non-finite on every
        # rank, so all ranks take the same branch and bad weights are never stepped into.
        if not torch.isfinite(grad_norm).item():
            self.handle_nonfinite(loss_sum, global_tokens, grad_norm)
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss_sum": loss_sum, "tokens": global_tokens, "grad_norm": grad_norm}

    def handle_nonfinite(self, loss_sum, global_tokens, grad_norm):
        step = self.state.step + 1  # the step being taken, numbered as in the logs
        loss = dist_sum(loss_sum, self.parallel_dims.dp_mesh) / global_tokens
        msg = (
            f"non-finite values at step {step}: loss {loss.item():.6g}, "
            f"grad norm {grad_norm.item():.6g}; the optimizer step was not taken"
        )
        if self.cfg.training.on_nonfinite == "skip":
            self.state.skipped_steps += 1
            logger.warning("%s (skipped; %d skipped so far)", msg, self.state.skipped_steps)
            return
        raise NonFiniteError(
            f"{msg}. The last checkpoint is untouched. Lower optimizer.lr, check the data, or "
            f"set --training.on_nonfinite skip."
        )

    @torch.no_grad()
    def validate(self) -> dict:
        """Global token-weighted validation loss: every batch counted once, never a mean of
        batch means."""
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device)
        for tok, labels in self.val_loader.iter_batches(self.cfg.validation.steps):
            tok, labels = tok.to(self.device), labels.to(self.device)
            with self.loss_parallel(), self.autocast():
                loss_sum += _local(self.model(tok, labels, chunk_tokens=self.cfg.loss.chunk_tokens))
            tokens += (labels != -100).sum()
        self.model.train()
        if hasattr(self.model, "reshard"):  # FSDP's root stays unsharded after a no-grad forward
            self.model.reshard()
        dp_mesh = self.parallel_dims.dp_mesh
        val_loss = (dist_sum(loss_sum, dp_mesh) / dist_sum(tokens, dp_mesh)).item()
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    def write_seed_checkpoint(self) -> int:
        """Step 0, weights only: a fixed starting point any later layout can load."""
        self.checkpointer.save(0)
        logger.info("seed checkpoint written: step 0")
        return 0

    def train(self) -> int:
        cfg, st = self.cfg, self.state
        self.checkpointer.install_signal_handlers()
        logger.info("training from step %d to %d", st.step, cfg.training.steps)
        tokens_per_step = cfg.training.global_batch_size * cfg.training.seq_len
        window = Window()
        with (
            maybe_enable_profiling(cfg.profiling, cfg.job.dump_folder, st.step, self.rank) as prof,
            maybe_enable_memory_snapshot(
                cfg.profiling, cfg.job.dump_folder, st.step, self.rank
            ) as snapshot,
        ):
            while st.step < cfg.training.steps:
                t0 = time.perf_counter()
                microbatches = self.loader.next_step()
                t_data = time.perf_counter() - t0
                out = self.train_step(microbatches)
                st.step += 1
                st.tokens_seen += tokens_per_step
                window.add(out, t_data, time.perf_counter() - t0)
                prof.step()
                snapshot.step()
                last = st.step == cfg.training.steps
                if st.step % cfg.metrics.log_freq == 0 or last or st.step == 1:
                    self.log(window)
                    window = Window()
                stop = self.checkpointer.should_stop()
                self.checkpointer.maybe_save(st.step, last_step=last or stop)
                if stop:
                    logger.warning("stop requested by signal: saved step %d, exiting", st.step)
                    break
        return 0

    def close(self):
        """Finish an in-flight async save, flush the logs, stop the prefetch threads."""
        self.checkpointer.close()
        self.metrics.close()
        for loader in (self.loader, self.val_loader):
            if loader is not None:
                loader.close()

    def log(self, window: "Window"):
        cfg, pd = self.cfg, self.parallel_dims
        st = self.state
        values = window.summarize(pd.dp_mesh)
        tokens_per_device = cfg.training.global_batch_size * cfg.training.seq_len / self.world_size
        wps = tokens_per_device * window.steps / window.time
        tflops = self.flops_per_token * wps / 1e12
        st.elapsed_s += window.time
        values.update(
            lr=self.scheduler.get_last_lr()[0],
            wps=wps,
            tflops=tflops,
            mfu=None if self.peak_flops is None else 100 * tflops * 1e12 / self.peak_flops,
            memory_gib=self.memory.get_peak_stats().max_reserved_gib,
            data_time_pct=100 * window.data_time / window.time,
            elapsed_s=st.elapsed_s,
        )
        if self.val_loader is not None and (
            st.step % cfg.validation.freq == 0 or st.step == cfg.training.steps
        ):
            values.update(self.validate())
        self.metrics.log(st.step, values)
        self.memory.reset_peak_stats()


class Window:
    """Sums over the steps between two log lines; reduced across ranks only when logged."""

    def __init__(self):
        self.steps, self.time, self.data_time = 0, 0.0, 0.0
        self.last = None

    def add(self, out: dict, t_data: float, t_step: float):
        self.steps += 1
        self.time += t_step
        self.data_time += t_data
        self.last = out

    def summarize(self, dp_mesh) -> dict:
        out = self.last
        loss = dist_sum(out["loss_sum"], dp_mesh) / out["tokens"]
        return {"loss": loss.item(), "grad_norm": out["grad_norm"].item()}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The loss under loss-parallel is a replicated DTensor; its local value is the loss."""
    return t.to_local() if hasattr(t, "to_local") else t


def main(argv=None) -> int:
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"titanlite: error: {e}", file=sys.stderr)
        return 2
    dist_env = init_distributed()
    rank = dist_env[0]
    init_logger(rank, int(os.environ.get("LOG_RANK", 0)))
    torch.manual_seed(cfg.training.seed)
    if cfg.training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        trainer = Trainer(cfg, dist_env)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        # User mistakes found before any weight is allocated: one line, no traceback wall.
        # Every rank fails the same way, so one of them says it.
        if rank == 0:
            print(f"titanlite: error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        os.makedirs(cfg.job.dump_folder, exist_ok=True)
        dump_toml(cfg, os.path.join(cfg.job.dump_folder, "config.toml"))
    if cfg.job.print_config:
        logger.info("config:\n%s", cfg.to_dict())
    trainer.build()
    try:
        if not cfg.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.load()
    except (ValueError, RuntimeError) as e:
        # A missing, partial, corrupt or mismatched checkpoint: say which and stop, never
        # silently start fresh.
        if rank == 0:
            print(f"titanlite: error: {e}", file=sys.stderr)
        trainer.close()
        return 2
    try:
        if cfg.checkpoint.create_seed_checkpoint:
            code = trainer.write_seed_checkpoint()
        else:
            code = trainer.train()
    except NonFiniteError as e:  # raised on every rank alike: the global norm is shared
        logger.error("%s", e)
        code = 3
    # Only on exits every rank takes together: teardown has barriers that a crashed peer would
    # hang; after an unexpected error the process just dies and torchrun stops the others.
    trainer.close()
    destroy()
    return code


if __name__ == "__main__":
    sys.exit(main())
