"""Activation checkpointing: full, every k-th block, or per operator (selective).

Recomputing activations in backward trades compute for memory; it is what lets the 3B–13B
presets fit at long context. Three modes (``activation_checkpointing`` in the recipe):

* ``full``: every decoder block is recomputed in backward (``torch.utils.checkpoint``,
  non-reentrant); only each block's input is kept.
* ``selective`` with ``selective_ac: k`` (an integer): every k-th block (the k-th, 2k-th, …,
  counting from 1) is recomputed in full, the others keep their activations.
* ``selective`` with ``selective_ac: op``: every block is checkpointed with a policy that
  *keeps* the outputs of the expensive operators (matrix multiplications and attention kernels,
  :data:`SAVED_OPS`, and any operator of the ``diffattn_*`` kernel namespaces) and recomputes
  the cheap element-wise work (norms, RoPE, SwiGLU's activation, λ, the differential
  combination) — PyTorch's selective activation checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``).

Every mode computes the same gradients as none (recomputation repeats the same operations on
the same inputs). The block's ``forward`` is wrapped on the instance, so parameter names, and
so checkpoints, do not change.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

SAVED_OPS = frozenset(
    {
        "aten.mm.default",
        "aten.bmm.default",
        "aten.addmm.default",
        "aten.linear.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
    }
)
"""Operators whose outputs ``selective_ac: op`` keeps (by name, so every release has them)."""
KERNEL_NAMESPACES = ("diffattn",)
"""Operators of custom-op namespaces starting with these (the compiled CPU and Triton DIFF V1
kernels) are kept too: they are the attention itself."""


def _keeps(func: Any) -> bool:
    name = str(func)
    return name in SAVED_OPS or name.split(".")[0].startswith(KERNEL_NAMESPACES)


def _op_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if _keeps(func) else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_op_policy)


def _wrap(block: nn.Module, context_fn: Any | None) -> None:
    from torch.utils.checkpoint import checkpoint

    inner = block.forward
    extra = {} if context_fn is None else {"context_fn": context_fn}

    def forward(*args: Any, _inner=inner, **kwargs: Any):
        return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = forward


def checkpointed_blocks(count: int, mode: str, selective: str | int = "op") -> list[int]:
    """Indices (0-based) of the blocks a mode wraps among ``count`` blocks."""
    if mode == "none":
        return []
    if mode == "full" or selective == "op":
        return list(range(count))
    if mode != "selective" or not isinstance(selective, int) or selective < 1:
        raise ValueError(f"unknown activation checkpointing {mode!r} / {selective!r}")
    return [i for i in range(count) if (i + 1) % selective == 0]


def apply_activation_checkpointing(
    blocks: nn.ModuleList, mode: str = "full", selective: str | int = "op"
) -> list[int]:
    """Wrap ``blocks`` for ``mode`` (see the module docstring); returns the wrapped indices."""
    wrapped = checkpointed_blocks(len(blocks), mode, selective)
    per_op = mode == "selective" and selective == "op"
    context_fn = functools.partial(_op_context) if per_op else None
    for index in wrapped:
        _wrap(blocks[index], context_fn)
    return wrapped
