"""Tensor parallelism for the three attention types, on PyTorch's DTensor engine.

:func:`apply_tensor_parallel` shards a :class:`~diffattn.model.DiffTransformerLM` in place with
``torch.distributed.tensor.parallel.parallelize_module`` over a 1-D ``tp`` mesh (Megatron-LM's
split: column-parallel projections into the heads or the FFN hidden width, row-parallel
projections back into the residual stream, one all-reduce after each). The collectives are
DTensor's; nothing here communicates by hand.

**Attention is split by KV groups**, so whatever must meet stays on one rank. The projection
layouts already make a contiguous block of output rows a set of whole KV groups, so a plain
``ColwiseParallel`` (``Shard(0)`` of the weight) is the right shard, with no permutation:

* baseline: query heads ``[g·r, (g+1)·r)`` read KV head g (``r = H / H_kv``);
* DIFF V1 (Eq.1–3): differential head j owns query half-heads ``(2j, 2j+1)`` = (Q1, Q2); KV
  group g owns key half-heads ``(2g, 2g+1)`` = (K1, K2) and V head g of width 2d; head j reads
  group ``j // r``. A rank holding groups ``[a, b)`` holds key rows ``[2a·d, 2b·d)``, value
  rows ``[2a·d, 2b·d)`` and query rows ``[2a·r·d, 2b·r·d)``: exactly its groups' half-heads;
* DIFF V2: the query heads of a group, pairs ``(2i, 2i+1)`` included, are contiguous, and
  ``W_λ`` is split by output head, so λ_i sits with the pair it weights.

``W_O`` and the FFN's ``down_proj`` are ``RowwiseParallel``; ``gate_proj`` / ``up_proj`` are
``ColwiseParallel``. The modules read their head counts from the projections' output sizes
(:func:`diffattn.attention.common.split_heads`), so every backend (``reference``, ``sdpa``,
``fused``, ...) runs unchanged on the rank's local heads, the per-head norm included.

Parameters every rank holds whole are replicated DTensors: the RMSNorms of the residual
stream (their inputs enter as ``Replicate`` DTensors, :class:`ReplicatedParallel`) and DIFF
V1's λ vectors and per-head norm weight, which act on local heads: their gradient on a rank is
that rank's heads' share, summed over the mesh by :func:`diffattn.layers.local_share`. The
token embedding is split by vocabulary rows (``RowwiseParallel``) and the LM head by output
columns (``ColwiseParallel``, logits gathered), so no rank holds a whole vocabulary matrix.

Refused (:func:`tp_problem`): a degree that does not divide the KV groups, the FFN width or the
vocabulary; tied embeddings (the LM head would read the row-sharded embedding); DIFF V2's
``v2_paired_heads=False`` ablation, whose pairs ``(i, i + h)`` lie in different groups.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from diffattn.config import ModelConfig


def kv_groups(config: ModelConfig) -> int:
    """The number of KV groups: the units tensor parallelism splits attention by."""
    return config.single_type("kv_groups").kv_units(config)


def tp_problem(config: ModelConfig, tp: int) -> str | None:
    """Why ``config``'s model cannot be split over ``tp`` ranks, or ``None`` when it can."""
    if tp == 1:
        return None
    for declaration in config.attention_types:
        if not declaration.tensor_parallel:
            return declaration.tp_problem(config, tp)
    for declaration in config.attention_types:
        groups = declaration.kv_units(config)
        if groups % tp:
            return f"tp={tp} does not divide the model's {groups} KV groups"
    if config.ffn_dim % tp:
        return f"tp={tp} does not divide the FFN width {config.ffn_dim}"
    if config.vocab_size % tp:
        return f"tp={tp} does not divide vocab_size={config.vocab_size} (embedding rows)"
    if config.tie_embeddings:
        return "tied embeddings are not supported with tp > 1 (set model.tie_embeddings: false)"
    for declaration in config.attention_types:
        problem = declaration.tp_problem(config, tp)
        if problem is not None:
            return problem
    return None


def _replicate_plain_parameters(name: str, module: nn.Module, mesh) -> None:
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    for key, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            continue
        replicated = distribute_tensor(param.data, mesh, [Replicate()])
        module.register_parameter(key, nn.Parameter(replicated, param.requires_grad))


def _style_base():
    from torch.distributed.tensor.parallel import ParallelStyle

    return ParallelStyle


class ReplicatedParallel(_style_base()):
    """Every parameter of the module replicated over the mesh as a ``Replicate`` DTensor.

    ``stream=True`` (RMSNorms of the residual stream): plain inputs, the same on every rank,
    enter as ``Replicate`` DTensors and outputs leave as plain tensors, so the weight's
    gradient is the full one on every rank. ``stream=False`` (DIFF V1's attention: λ vectors
    and the per-head norm): the module sees local heads; :func:`diffattn.layers.local_share`
    sums the gradient shares."""

    def __init__(self, stream: bool = True) -> None:
        super().__init__()
        self.stream = stream

    @staticmethod
    def _inputs(module, inputs, mesh):
        from torch.distributed.tensor import DTensor, Replicate

        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    @staticmethod
    def _outputs(module, outputs, mesh):
        from torch.distributed.tensor import DTensor

        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        if not self.stream:
            return distribute_module(module, device_mesh, _replicate_plain_parameters)
        return distribute_module(
            module, device_mesh, _replicate_plain_parameters, self._inputs, self._outputs
        )


def tp_plan(config: ModelConfig) -> dict[str, Any]:
    """The ``parallelize_module`` plan of ``DiffTransformerLM(config)`` (see the module
    docstring), keyed by module names with ``*`` for the block index."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "layers.*.attn_norm": ReplicatedParallel(),
        "layers.*.attn.q_proj": ColwiseParallel(),
        "layers.*.attn.k_proj": ColwiseParallel(),
        "layers.*.attn.v_proj": ColwiseParallel(),
        "layers.*.attn.o_proj": RowwiseParallel(),
        "layers.*.ffn_norm": ReplicatedParallel(),
        "layers.*.ffn.gate_proj": ColwiseParallel(),
        "layers.*.ffn.up_proj": ColwiseParallel(),
        "layers.*.ffn.down_proj": RowwiseParallel(),
        "norm": ReplicatedParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    # Each type's own entries, under its attention module (DIFF V1: the module replicated
    # after its projections; DIFF V2: W_λ by column, λ_i beside its head pair).
    layers = ["*"] if not config.is_mixed else range(config.n_layers)
    for layer in layers:
        declaration = config.type_of_layer(0 if layer == "*" else layer)
        own = declaration.tp_plan(config, ColwiseParallel, ReplicatedParallel)
        for path, style in own.items():
            plan[f"layers.{layer}.attn" + (f".{path}" if path else "")] = style
    return plan


def apply_tensor_parallel(model: nn.Module, mesh) -> nn.Module:
    """Shard ``model`` (a :class:`~diffattn.model.DiffTransformerLM`, on any device, the meta
    device included) over the 1-D device mesh ``mesh`` in place; returns it.

    Raises:
        ValueError: the model is not a ``DiffTransformerLM`` or cannot be split over
            ``mesh.size()`` ranks (:func:`tp_problem`).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from diffattn.model import DiffTransformerLM

    if not isinstance(model, DiffTransformerLM):
        raise ValueError(
            f"tensor parallelism applies to diffattn preset models, not {type(model).__name__}"
        )
    problem = tp_problem(model.config, mesh.size())
    if problem is not None:
        raise ValueError(problem)
    return parallelize_module(model, mesh, tp_plan(model.config))


def device_meshes(device_type: str, world_size: int, tp: int):
    """``(dp_mesh, tp_mesh)`` of a launch of ``world_size`` processes: a 2-D mesh
    ``(dp_shard, tp)`` with the ``tp`` ranks of a group consecutive (one node's GPUs share its
    fast links); ``dp_mesh`` has one rank when ``tp`` is the whole world (FSDP2 then shards
    over that one rank, so ``parallel: fsdp`` with ``tp`` = world size runs, as pure TP)."""
    from torch.distributed.device_mesh import init_device_mesh

    if world_size % tp:
        raise ValueError(f"tp={tp} does not divide the world size {world_size}")
    mesh = init_device_mesh(device_type, (world_size // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    return mesh["dp_shard"], mesh["tp"]
