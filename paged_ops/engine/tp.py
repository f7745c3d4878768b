"""Tensor parallelism: what one rank of a sharded ``transformers`` model holds.

``AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")`` under ``torchrun`` shards every
attention layer's projections column-wise over the ranks (``q_proj``/``k_proj``/``v_proj``
split by output rows, ``o_proj`` by input columns, whose partial sums are all-reduced). Each
rank then computes attention for its own slice of the query and key/value heads, so its KV
cache needs only those heads. The config keeps the model's global head counts; the weights
are ``DTensor``s whose ``.shape`` is global too, and only their local tensors show what the
rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["TPLayout", "tp_layout"]


@dataclass(frozen=True)
class TPLayout:
    """One rank's share of the attention heads.

    ``world_size``/``rank``: of the model's tensor-parallel group (1/0 unsharded);
    ``num_heads``/``num_kv_heads``: the query/key-value heads this rank computes and caches;
    ``head_dim``: per head (never sharded); ``group``: the tensor-parallel process group
    (``None`` unsharded).
    """

    world_size: int
    rank: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    group: object = field(default=None, compare=False, repr=False)

    def shared_seed(self, device) -> int:
        """A random seed, the same on every rank: rank 0's draw from torch's default
        generator, broadcast (the ranks' default generators need not agree)."""
        seed = torch.randint(0, 2**62, (), dtype=torch.int64)
        if self.world_size > 1:
            import torch.distributed as dist
            seed = seed.to(device)
            dist.broadcast(seed, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(seed.item())


def _local_rows(weight: torch.Tensor) -> int:
    """Output rows of a linear weight held by this rank (a DTensor's local shard)."""
    to_local = getattr(weight, "to_local", None)
    return int((to_local() if callable(to_local) else weight).shape[0])


def _tp_group(model, attn) -> tuple[int, int, object]:
    """``(world size, rank, process group)`` of the model's tensor-parallel mesh, ``(1, 0,
    None)`` without one: transformers' ``_tp_size``/``_device_mesh``, else the mesh of a
    DTensor ``k_proj`` weight (``attn``: an attention layer or ``None``)."""
    size = int(getattr(model, "_tp_size", None) or 1)
    mesh = getattr(model, "_device_mesh", None) if size > 1 else None
    if size == 1 and attn is not None:
        mesh = getattr(attn.k_proj.weight, "device_mesh", None)
        if mesh is not None and mesh.ndim == 1:
            size = mesh.size()
    if size == 1:
        return 1, 0, None
    if mesh is not None:
        return size, int(mesh.get_local_rank()), mesh.get_group()
    import torch.distributed as dist
    return size, int(dist.get_rank()), dist.group.WORLD


def _attention_module(model):
    """The first attention layer with separate ``q_proj``/``k_proj`` linears, or ``None``."""
    for module in model.modules():
        if (hasattr(module, "layer_idx") and isinstance(getattr(module, "q_proj", None),
                                                          torch.nn.Linear)
                and isinstance(getattr(module, "k_proj", None), torch.nn.Linear)):
            return module
    return None


def tp_layout(model, num_heads: int, num_kv_heads: int, head_dim: int) -> TPLayout:
    """This rank's heads of ``model`` whose config gives ``num_heads``/``num_kv_heads`` in all.

    Unsharded models return the config's counts. Sharded ones (transformers' ``tp_plan``) need
    both counts divisible by the tensor-parallel world size (``ValueError`` otherwise: a rank
    would hold part of a head, which no attention kernel can use); the local counts then come
    from the attention projections' local rows (``k_proj`` rows / ``head_dim``), checked
    against ``count / world_size``.
    """
    attn = _attention_module(model)
    world, rank, group = _tp_group(model, attn)
    if world == 1:
        return TPLayout(1, 0, num_heads, num_kv_heads, head_dim)
    for name, count in (("num_attention_heads", num_heads), ("num_key_value_heads",
                                                              num_kv_heads)):
        if count % world:
            raise ValueError(
                f"tensor parallel: the model's {name}={count} is not divisible by the "
                f"tensor-parallel world size {world}; every rank must hold whole heads "
                f"(use a world size that divides {count})")
    local_heads, local_kv = num_heads // world, num_kv_heads // world
    if attn is not None:
        head_dim = int(getattr(attn, "head_dim", head_dim))
        q_rows, k_rows = _local_rows(attn.q_proj.weight), _local_rows(attn.k_proj.weight)
        if q_rows % head_dim or k_rows % head_dim:
            raise ValueError(
                f"tensor parallel: rank {rank} holds {q_rows} q_proj and {k_rows} k_proj "
                f"rows, not whole heads of head_dim {head_dim}")
        local_heads, local_kv = q_rows // head_dim, k_rows // head_dim
        if local_heads * world != num_heads or local_kv * world != num_kv_heads:
            raise ValueError(
                f"tensor parallel: rank {rank} holds {local_heads} query / {local_kv} KV heads "
                f"but the config's {num_heads} / {num_kv_heads} heads over {world} ranks give "
                f"{num_heads // world} / {num_kv_heads // world}: an unsupported sharding plan")
    return TPLayout(world, rank, local_heads, local_kv, head_dim, group)
