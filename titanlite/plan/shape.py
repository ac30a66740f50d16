"""What the planner reads from a job config: the model's shape and a Layout of the config's own
options (for --predict, calibration and the record a training run writes)."""

from dataclasses import dataclass, replace

from titanlite.build import model_args_for_vocab
from titanlite.float8 import float8_enabled
from titanlite.memory_estimate import param_counts
from titanlite.models import get_family
from titanlite.plan.perf import Layout, Shape


@dataclass(frozen=True)
class Model:
    """A model as the planner sees it: its args (for the memory estimator) and its Shape."""

    name: str  # model.name
    args: object
    counts: dict
    shape: Shape


def model_of(cfg, vocab_size: int, seq_len: int | None = None) -> Model:
    """The config's model at `vocab_size` (padded) and `seq_len` (default the config's)."""
    if seq_len:
        cfg = replace(cfg, training=replace(cfg.training, seq_len=seq_len))
    seq = cfg.training.seq_len
    args = model_args_for_vocab(cfg, vocab_size)
    counts = param_counts(args, cfg.model.name)
    family = get_family(cfg.model.name)
    head_dim = args.dim // args.n_heads
    shape = Shape(
        dim=args.dim,
        ffn_dim=args.ffn_hidden_dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        head_dim=head_dim,
        kv_dim=(args.n_kv_heads or args.n_heads) * head_dim,
        vocab=args.vocab_size,
        block_linear_params=counts["block_split"],
        params_total=counts["total"],
        flops_per_token=family.flops_per_token(counts["total"] - counts["embedding"], args, seq),
        seq_len=seq,
    )
    return Model(cfg.model.name, args, counts, shape)


def layout_of(cfg, world_size: int) -> Layout:
    """The layout a config runs on `world_size` ranks (degrees resolved as training does)."""
    from titanlite.checks import resolve_global_batch
    from titanlite.parallel_dims import ParallelDims

    p, t = cfg.parallelism, cfg.training
    pd = ParallelDims.from_config(p, world_size)
    _, accumulation = resolve_global_batch(t, pd.dp_degree)
    return Layout(
        tp=pd.tp, cp=pd.cp, pp=pd.pp, dp_replicate=pd.dp_replicate, dp_shard=pd.dp_shard,
        schedule=p.pipeline_parallel_schedule, local_batch_size=t.local_batch_size,
        pp_microbatch_size=p.pipeline_parallel_microbatch_size,
        accumulation=accumulation, ac=cfg.activation_checkpoint.mode,
        chunk_tokens=cfg.loss.chunk_tokens, float8=float8_enabled(cfg), compile=cfg.compile.enable,
    )  # fmt: skip


LLAMA3_VOCAB = 128256


def vocab_size_of(cfg) -> tuple[int, str]:
    """(the padded vocab of the config's tokenizer, ''), or Llama 3's and why where the tokenizer
    cannot be built here (a cluster's tokenizer file, planned for on a laptop)."""
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.models import pad_vocab

    try:
        return pad_vocab(build_tokenizer(cfg.model).n_words), ""
    except (OSError, ValueError) as e:
        return LLAMA3_VOCAB, f"tokenizer not available here ({e}); Llama 3's vocab assumed"
