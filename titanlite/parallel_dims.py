"""Parallel degrees, their validation, and the named world DeviceMesh.

Ranks are laid out row-major over ("pp", "dp_replicate", "dp_shard", "cp", "tp"): TP neighbours
are adjacent ranks (same host, fastest links), then CP peers (one all-gather of K/V per layer),
then data parallelism; pipeline stages are the farthest apart (they only pass activations).
"""

import contextlib

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from titanlite.config import ConfigError
from titanlite.torch_compat import flatten_mesh, track_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def _spelled(degrees) -> str:
    return " x ".join(f"{name} ({value})" for name, value in degrees)


class ParallelDims:
    """Degrees of pipeline, data (replicate x shard), context and tensor parallelism for one job.

    dp_shard = -1 takes whatever the other degrees leave of the world. Errors name the config
    keys so the user knows what to change.
    """

    def __init__(
        self, dp_replicate: int, dp_shard: int, tp: int, world_size: int, cp: int = 1, pp: int = 1
    ):
        fixed = (
            ("pipeline_parallel_degree", pp),
            ("data_parallel_replicate_degree", dp_replicate),
            ("context_parallel_degree", cp),
            ("tensor_parallel_degree", tp),
        )
        for name, value in fixed:
            if value < 1:
                raise ConfigError(f"parallelism.{name} must be >= 1, got {value}")
        others = pp * dp_replicate * cp * tp
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"cannot infer data_parallel_shard_degree: world size {world_size} is not "
                    f"divisible by {_spelled(fixed)} = {others}; choose degrees whose product "
                    f"divides {world_size}"
                )
            dp_shard = world_size // others
        elif dp_shard < 1:
            raise ConfigError(
                f"parallelism.data_parallel_shard_degree must be >= 1 or -1 (infer), got {dp_shard}"
            )
        product = dp_shard * others
        if product != world_size:
            degrees = (*fixed[:2], ("data_parallel_shard_degree", dp_shard), *fixed[2:])
            raise ConfigError(
                f"{_spelled(degrees)} = {product}, but the world size is {world_size}; make the "
                f"product equal the number of processes (or set data_parallel_shard_degree = -1 "
                f"to infer it)"
            )
        self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp = (
            pp,
            dp_replicate,
            dp_shard,
            cp,
            tp,
        )
        self.world_size = world_size
        self.world_mesh: DeviceMesh | None = None  # set by build_mesh
        self._dp_mesh: DeviceMesh | None = None
        self._loss_mesh: DeviceMesh | None = None
        self._fsdp_mesh: DeviceMesh | None = None
        self._counts_step_tokens: bool | None = None

    @classmethod
    def from_config(cls, parallelism_cfg, world_size: int) -> "ParallelDims":
        """The degrees a config's [parallelism] section asks for, on `world_size` ranks: the one
        way to build ParallelDims from a config."""
        p = parallelism_cfg
        return cls(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            tp=p.tensor_parallel_degree, world_size=world_size, cp=p.context_parallel_degree,
            pp=p.pipeline_parallel_degree,
        )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"ParallelDims(pp={self.pp}, dp_replicate={self.dp_replicate}, "
            f"dp_shard={self.dp_shard}, cp={self.cp}, tp={self.tp}, world_size={self.world_size})"
        )

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def fsdp_enabled(self) -> bool:
        # Pure replication is run through FSDP's HSDP path with a shard group of 1 (DDP semantics).
        # CP peers hold the same weights and sum their gradients: FSDP shards over them too.
        return self.dp_enabled or self.cp_enabled

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    def validate_model(self, model_args) -> None:
        """Check the degrees against the model shapes, before any weight is allocated."""
        n_heads = model_args.n_heads
        n_kv_heads = model_args.n_kv_heads or n_heads
        if n_heads % self.tp or n_kv_heads % self.tp:
            raise ConfigError(
                f"tensor_parallel_degree ({self.tp}) must divide both n_heads ({n_heads}) and "
                f"n_kv_heads ({n_kv_heads}): each TP rank owns whole heads; pick a degree that "
                f"divides {n_kv_heads}"
            )
        hidden = model_args.ffn_hidden_dim
        for name, size in (("dim", model_args.dim), ("ffn hidden dim", hidden)):
            if size % self.tp:
                raise ConfigError(
                    f"tensor_parallel_degree ({self.tp}) must divide the model {name} ({size})"
                )
        seq_len = model_args.max_seq_len
        if self.cp_enabled and seq_len % (2 * self.cp):
            raise ConfigError(
                f"training.seq_len ({seq_len}) must be divisible by 2 x context_parallel_degree "
                f"({2 * self.cp}): each CP rank takes two of 2 x CP equal chunks of every "
                f"sequence; pick a seq_len that is a multiple of {2 * self.cp}"
            )

    def loss_parallel(self, parallelism_cfg) -> bool:
        """The loss on vocab-sharded logits: under TP unless the config turns it off."""
        return self.tp_enabled and not parallelism_cfg.disable_loss_parallel

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh (all four named dims, size-1 ones kept), world 1 included, and the
        flattened meshes the trainer reduces over.

        Keeping size-1 dims makes every slice below valid for any layout, at the cost of a few
        unused one-rank groups. The root mesh is tracked so that teardown releases its groups.
        """
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        self.world_mesh = track_mesh(mesh)
        if self.dp_enabled:
            self._dp_mesh = flatten_mesh(mesh[("dp_replicate", "dp_shard")], "dp")
        if self.dp_enabled or self.cp_enabled or self.pp_enabled:
            # Under PP only the last stage's sums are not zero: adding over pp brings the loss
            # to every rank, the log rank (on the first stage) included.
            dims = ("pp", "dp_replicate", "dp_shard", "cp")
            self._loss_mesh = flatten_mesh(mesh[dims], "pp_dp_cp")
        self._fsdp_mesh = mesh["dp_shard"]
        if self.cp_enabled:
            self._fsdp_mesh = flatten_mesh(mesh[("dp_shard", "cp")], "dp_shard_cp")
        if self.hsdp_enabled:
            self._fsdp_mesh = mesh[("dp_replicate", self._fsdp_mesh.mesh_dim_names[0])]
        # Asked every step: slicing the mesh then would cost host syncs.
        self._counts_step_tokens = all(mesh[d].get_local_rank() == 0 for d in ("pp", "cp", "tp"))
        return mesh

    def _mesh(self) -> DeviceMesh:
        assert self.world_mesh is not None, "call build_mesh() first"
        return self.world_mesh

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """Flattened 1-D data-parallel mesh ("dp"), or None when there is no data parallelism.
        Ranks of one dp index read the same samples (CP and TP peers)."""
        return self._dp_mesh

    @property
    def loss_mesh(self) -> DeviceMesh | None:
        """The ranks whose loss sums add up to the step's loss: pp x dp x cp (each CP rank holds
        a part of every sequence, the last pipeline stage the loss), flattened; None when there
        is none of them."""
        return self._loss_mesh

    @property
    def dp_rank(self) -> int:
        return self._dp_mesh.get_local_rank() if self._dp_mesh is not None else 0

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """Mesh for fully_shard: 1-D over dp_shard x cp (one rank when there is neither and FSDP
        only does mixed precision), or 2-D with dp_replicate for HSDP."""
        assert self._fsdp_mesh is not None, "call build_mesh() first"
        return self._fsdp_mesh

    @property
    def counts_step_tokens(self) -> bool:
        """Whether this rank adds its labels to the step's token count (counted before the CP
        split): TP, CP and PP peers hold the same labels, so only the first of each group does."""
        assert self._counts_step_tokens is not None, "call build_mesh() first"
        return self._counts_step_tokens

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self._mesh()["tp"] if self.tp_enabled else None

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        return self._mesh()["cp"] if self.cp_enabled else None

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        return self._mesh()["pp"] if self.pp_enabled else None


def loss_parallel_ctx(enabled: bool):
    """Context for forward AND backward (CE backward on vocab-sharded logits needs it too)."""
    return loss_parallel() if enabled else contextlib.nullcontext()
