"""Parallel degrees, their validation, and the named world DeviceMesh.

Ranks are laid out row-major over ("dp_replicate", "dp_shard", "tp"): TP neighbours are adjacent
ranks (same host, fastest links), replicas are the farthest apart.
"""

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


class ParallelDims:
    """Degrees of data (replicate x shard) and tensor parallelism for one job.

    dp_shard = -1 takes whatever the other degrees leave of the world. Errors name the config
    keys so the user knows what to change.
    """

    def __init__(self, dp_replicate: int, dp_shard: int, tp: int, world_size: int):
        for name, value in (
            ("data_parallel_replicate_degree", dp_replicate),
            ("tensor_parallel_degree", tp),
        ):
            if value < 1:
                raise ValueError(f"parallelism.{name} must be >= 1, got {value}")
        if dp_shard == -1:
            if world_size % (dp_replicate * tp):
                raise ValueError(
                    f"cannot infer data_parallel_shard_degree: world size {world_size} is not "
                    f"divisible by data_parallel_replicate_degree ({dp_replicate}) x "
                    f"tensor_parallel_degree ({tp}) = {dp_replicate * tp}; choose degrees whose "
                    f"product divides {world_size}"
                )
            dp_shard = world_size // (dp_replicate * tp)
        elif dp_shard < 1:
            raise ValueError(
                f"parallelism.data_parallel_shard_degree must be >= 1 or -1 (infer), got {dp_shard}"
            )
        product = dp_replicate * dp_shard * tp
        if product != world_size:
            raise ValueError(
                f"data_parallel_replicate_degree ({dp_replicate}) x data_parallel_shard_degree "
                f"({dp_shard}) x tensor_parallel_degree ({tp}) = {product}, but the world size is "
                f"{world_size}; make the product equal the number of processes (or set "
                f"data_parallel_shard_degree = -1 to infer it)"
            )
        self.dp_replicate, self.dp_shard, self.tp = dp_replicate, dp_shard, tp
        self.world_size = world_size
        self.world_mesh: DeviceMesh | None = None  # set by build_mesh
        self._dp_mesh: DeviceMesh | None = None

    def __repr__(self) -> str:
        return (
            f"ParallelDims(dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, "
            f"tp={self.tp}, world_size={self.world_size})"
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
    def fsdp_enabled(self) -> bool:
        # Pure replication is run through FSDP's HSDP path with a shard group of 1 (DDP semantics).
        return self.dp_enabled

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    def validate_model(self, model_args, parallelism_cfg=None) -> None:
        """Check the degrees against the model shapes and the loss options, before any weight is
        allocated. parallelism_cfg is the config section (optional)."""
        n_heads = model_args.n_heads
        n_kv_heads = model_args.n_kv_heads or n_heads
        if n_heads % self.tp or n_kv_heads % self.tp:
            raise ValueError(
                f"tensor_parallel_degree ({self.tp}) must divide both n_heads ({n_heads}) and "
                f"n_kv_heads ({n_kv_heads}): each TP rank owns whole heads; pick a degree that "
                f"divides {n_kv_heads}"
            )
        hidden = model_args.ffn_hidden_dim
        for name, size in (("dim", model_args.dim), ("ffn hidden dim", hidden)):
            if size % self.tp:
                raise ValueError(
                    f"tensor_parallel_degree ({self.tp}) must divide the model {name} ({size})"
                )
        loss_parallel = bool(parallelism_cfg and parallelism_cfg.enable_loss_parallel)
        if loss_parallel and not self.tp_enabled:
            raise ValueError(
                "parallelism.enable_loss_parallel needs tensor_parallel_degree > 1 (it splits the "
                "vocabulary over TP ranks); turn it off or raise the TP degree"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh (all three named dims, size-1 ones kept), world 1 included.

        Keeping size-1 dims makes every slice below valid for any layout, at the cost of a few
        unused one-rank groups.
        """
        shape = (self.dp_replicate, self.dp_shard, self.tp)
        self.world_mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        if self.dp_enabled:
            # _flatten is private but the only way (torch 2.11-2.13) to get one 1-D group over
            # both dp dims for the loader rank and the loss/metric all-reduces.
            self._dp_mesh = self.world_mesh[("dp_replicate", "dp_shard")]._flatten("dp")
        return self.world_mesh

    def _mesh(self) -> DeviceMesh:
        assert self.world_mesh is not None, "call build_mesh() first"
        return self.world_mesh

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """Flattened 1-D data-parallel mesh ("dp"), or None when there is no data parallelism."""
        return self._dp_mesh

    @property
    def dp_rank(self) -> int:
        return self._dp_mesh.get_local_rank() if self._dp_mesh is not None else 0

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """Mesh for fully_shard: 1-D dp_shard (one rank when there is no data parallelism and
        FSDP only does mixed precision), or 2-D (dp_replicate, dp_shard) for HSDP."""
        if self.hsdp_enabled:
            return self._mesh()[("dp_replicate", "dp_shard")]
        return self._mesh()["dp_shard"]

    @property
    def counts_step_tokens(self) -> bool:
        """Whether this rank adds its labels to the step's token count: TP peers hold the same
        labels, so only the first of each TP group does."""
        return not self.tp_enabled or self._mesh()["tp"].get_local_rank() == 0

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self._mesh()["tp"] if self.tp_enabled else None
