"""``DexHeads``: the per-layer Dex parameters and the map applied to the heads' outputs.

Dex paper Eq.5: for head h of a layer,

    O_h = softmax(Q_h K_hᵀ / √d) V_h,      O'_h = O_h − λ(t)·𝕀(h ∈ H)·f_D(O_h),

and the concatenated O' enters W_O. f_D is linear, ``f_D(O_h) = O_h W_D,h`` for the row
vectors O_h (the convention of App. F.3, where O' = O(I − W_D)), with one head_dim × head_dim
matrix per selected head, and λ(t) follows Eq.4 (:mod:`diffattn.dex.schedule`).

Every supported attention computes ``o_proj(concat_h O_h)``, so the map is applied to the
input of ``o_proj`` by a forward pre-hook; the module itself is registered as the child
``dex`` of the attention module, which puts its parameters and buffers into the state dict
(``...self_attn.dex.w_d`` etc.) while the pretrained weight names stay unchanged.

W_D initialisation (``w_d_init``): the default is the identity. With W_D = 0, f_D(O) = 0, so
∂L/∂λ = −⟨∂L/∂O', O W_D⟩ = 0 and λ_learn gets no gradient until W_D has moved, while
∂L/∂W_D = −λ(t)·Oᵀ ∂L/∂O' is scaled by λ(t) ≈ 0: both factors of the product λ·W_D start at
a saddle and the annealed λ_init only perturbs a no-op. With W_D = I, O' = (1 − λ)O: the
annealed λ_init really subtracts a λ-weighted copy of the head's output, the common-mode part
that DIFF's second map removes when A2 ≈ A1, so λ_learn receives ⟨∂L/∂O', O⟩ from the first
step on, W_D receives λ(t)·Oᵀ ∂L/∂O', and the change to the model is still exactly zero at
t = 0 because λ(0) = 0. ``"zeros"`` and a scaled identity ``s·I`` (a float) are available.
"""

from __future__ import annotations

import torch
from torch import nn

from diffattn.dex.annealing import lambda_schedule, schedule_coefficients
from diffattn.layers import memo_by_version

WDInit = str | float


def initial_w_d(spec: WDInit, k: int, head_dim: int, dtype, device) -> torch.Tensor:
    """The (k, d, d) initial W_D: ``"identity"`` (default), ``"zeros"`` or a float s (s·I)."""
    if spec == "identity":
        scale = 1.0
    elif spec == "zeros":
        scale = 0.0
    elif isinstance(spec, int | float) and not isinstance(spec, bool):
        scale = float(spec)
    else:
        raise ValueError(f"w_d_init must be 'identity', 'zeros' or a number, got {spec!r}")
    eye = torch.eye(head_dim, dtype=dtype, device=device)
    return (scale * eye).expand(k, head_dim, head_dim).clone()


class DexHeads(nn.Module):
    """Dex of one attention layer: W_D per selected head, λ_learn, and the schedule state.

    Attributes:
        heads: buffer (k,) of the selected head indices (sorted).
        w_d: parameter (k, d, d); ``w_d[i]`` is W_D of head ``heads[i]``.
        lambda_learn: learnable scalar λ_learn of the layer (fp32).
        lambda_init: buffer, the layer's λ_init constant of Eq.4.
        step: buffer, the annealing step t (int64), advanced by :func:`diffattn.dex.step`.
        anneal_steps: buffer, the annealing duration T (int64).
    """

    def __init__(
        self,
        layer_index: int,
        n_heads: int,
        head_dim: int,
        heads: list[int],
        lambda_init: float,
        anneal_steps: int,
        w_d_init: WDInit = "identity",
        lambda_learn_init: float = 0.0,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.w_d_init = w_d_init
        dtype = dtype if dtype is not None and dtype.is_floating_point else torch.float32
        self.register_buffer("heads", torch.tensor(sorted(heads), dtype=torch.long, device=device))
        self.w_d = nn.Parameter(initial_w_d(w_d_init, len(heads), head_dim, dtype, device))
        self.lambda_learn = nn.Parameter(
            torch.tensor(float(lambda_learn_init), dtype=torch.float32, device=device)
        )
        self.register_buffer(
            "lambda_init", torch.tensor(float(lambda_init), dtype=torch.float32, device=device)
        )
        self.register_buffer("step", torch.zeros((), dtype=torch.long, device=device))
        self.register_buffer(
            "anneal_steps", torch.tensor(int(anneal_steps), dtype=torch.long, device=device)
        )

    @property
    def selected(self) -> list[int]:
        return [int(h) for h in self.heads.tolist()]

    def lam(self) -> torch.Tensor:
        """λ(t) of Eq.4 at the current step, a 0-d fp32 tensor (differentiable in λ_learn).

        Eq.4 is ``offset(t) + α(t)·λ_learn`` with coefficients that depend on the buffers
        only; they are computed once per change of ``step``, ``anneal_steps`` or
        ``lambda_init`` (tracked by tensor identity and version counter), so a forward costs
        one fused multiply-add here instead of a dozen small ops.
        """
        learn = self.lambda_learn.float()
        if torch.compiler.is_compiling():
            return lambda_schedule(self.step, self.anneal_steps, self.lambda_init, learn)
        buffers = (self.step, self.anneal_steps, self.lambda_init)
        offset, alpha = memo_by_version(
            self, "_coefficients", buffers, lambda: schedule_coefficients(*buffers)
        )
        return torch.addcmul(offset, alpha, learn)

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., n_heads·d)`` → same shape with O_h − λ(t)·O_h W_D,h for selected h (Eq.5).

        The other heads pass through bitwise unchanged; at λ = 0 so do the selected ones.
        """
        width = self.n_heads * self.head_dim
        if x.shape[-1] != width:
            raise ValueError(
                f"Dex layer {self.layer_index}: o_proj input has {x.shape[-1]} features, "
                f"expected n_heads·head_dim = {self.n_heads}·{self.head_dim} = {width}"
            )
        heads = x.reshape(*x.shape[:-1], self.n_heads, self.head_dim)
        selected = heads.index_select(-2, self.heads)  # (..., k, d)
        # one batched product over the selected heads: (k, M, d) @ (k, d, d)
        rows = selected.reshape(-1, selected.shape[-2], self.head_dim).transpose(0, 1)
        f_d = torch.bmm(rows, self.w_d.to(x.dtype)).transpose(0, 1).reshape(selected.shape)
        delta = f_d * (-self.lam().to(x.dtype))
        return heads.index_add(-2, self.heads, delta).reshape(x.shape)

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook on ``o_proj``: transform its input before W_O."""
        if args:
            return (self.transform(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "input": self.transform(kwargs["input"])}

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_index}, heads={self.selected} of {self.n_heads}, "
            f"head_dim={self.head_dim}, lambda_init={float(self.lambda_init):.4f}, "
            f"T={int(self.anneal_steps)}"
        )
