"""``diffattn eval effective``: Dex's effective attention, its two estimates and how far they
agree (Dex App. F.3).

Dex changes a head's output, not its map: O' = A V (I − λW_D). The effective attention is a
map X with X V ≈ O'. App. F.3 estimates it by least squares, X_pinv = O' V⁺ (Eq. 6), and by
optimisation, X_optim: X started at A and updated on ||X V − O'||² (Adam, 100 steps at 1e-3 by
default). For each adapted head this command computes both on held-out windows, through the
capture probe (:func:`diffattn.dex.effective.head_tensors`), and reports:

* ``pinv_vs_optim``: relative Frobenius difference and row cosine of the two estimates;
* ``residual_pinv`` / ``residual_optim``: ||X V − O'|| / ||O'|| of each (how exactly each
  reproduces Dex's output);
* ``invisible_share``: ||A (I − V V⁺)||_F / ||A||_F, the part of A that V cannot see.

Where they disagree and why: with S keys and head width d, V is S × d. When S ≤ d, V has full
row rank and both estimates aim at the same least-squares solution. When S > d (the usual
case), X V = O' has a whole affine family of solutions X_pinv + Z (I − V V⁺): the
pseudo-inverse takes the minimum-norm one, while descent started at A keeps A's component
outside V's row space and heads for ``A + (O' − A V) V⁺`` (:func:`effective_attention_nearest`).
The two then differ by A (I − V V⁺), which changes no output; ``invisible_share`` measures it,
and ``nearest_vs_optim`` shows optimisation approaching the nearest solution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from diffattn.eval.common import (
    CommonOptions,
    EvalModel,
    command_main,
    markdown_table,
    one_axes,
    progress,
    save_axes,
)
from diffattn.eval.text import DataSettings, model_windows, open_documents
from diffattn.settings import like, setting, shared, takes_settings

NAME = "effective"
HELP = "Dex effective attention: pinv and optimisation estimates and their agreement (App. F.3)"


COUNTS = "--windows, --max-heads and --steps must be at least 1"


@dataclass(frozen=True)
class EffectiveSettings(DataSettings):
    """The settings of ``diffattn eval effective`` (and of :func:`run`)."""

    seq_len: int = like(DataSettings, "seq_len", 64)
    max_tokens: int = like(DataSettings, "max_tokens", 256)
    windows: int = setting(2, min=1, error=COUNTS, help="windows per head (default {default})")
    max_heads: int = setting(
        8, min=1, error=COUNTS, help="adapted heads to analyse, in layer order (default {default})"
    )
    steps: int = setting(100, min=1, error=COUNTS, help="optimisation steps (App. F.3)")
    lr: float = setting(1e-3, help="optimisation learning rate")
    optimizer: Literal["adam", "sgd"] = setting("adam")
    seed: int = shared(CommonOptions, "seed")


add_arguments = EffectiveSettings.add_arguments


def invisible_share(attn: torch.Tensor, values: torch.Tensor) -> float:
    """||A (I − V V⁺)||_F / ||A||_F: the share of A outside V's row space."""
    a, v = attn.double(), values.double()
    projector = v @ torch.linalg.pinv(v)  # (S, S)
    outside = a - a @ projector
    return float(outside.norm() / a.norm().clamp_min(1e-300))


def relative_residual(x: torch.Tensor, values: torch.Tensor, target: torch.Tensor) -> float:
    return float((x @ values.double() - target).norm() / target.double().norm().clamp_min(1e-300))


def head_report(tensors, steps: int, lr: float, optimizer: str) -> dict[str, float]:
    """The estimates of one head on one window and how they compare."""
    from diffattn.dex.effective import (
        agreement,
        effective_attention_nearest,
        effective_attention_optim,
        effective_attention_pinv,
    )

    args = (tensors.attn, tensors.values, tensors.w_d, tensors.lam)
    pinv = effective_attention_pinv(*args)
    optim = effective_attention_optim(*args, steps=steps, lr=lr, optimizer=optimizer)
    nearest = effective_attention_nearest(*args)
    target = tensors.dex_output.double()
    versus = agreement(optim, pinv)
    toward = agreement(optim, nearest)
    return {
        "pinv_vs_optim_rel": versus["rel_frobenius"],
        "pinv_vs_optim_row_cosine": versus["row_cosine_mean"],
        "nearest_vs_optim_rel": toward["rel_frobenius"],
        "residual_pinv": relative_residual(pinv, tensors.values, target),
        "residual_optim": relative_residual(optim, tensors.values, target),
        "invisible_share": invisible_share(tensors.attn, tensors.values),
        "keys": int(tensors.attn.shape[-1]),
        "head_dim": int(tensors.values.shape[-1]),
        "lam": float(tensors.lam),
    }


def adapted_heads(model: EvalModel, limit: int) -> list[tuple[int, int]]:
    from diffattn.dex import is_dex
    from diffattn.dex.adapter import selected_heads

    if not is_dex(model.model):
        raise ValueError(
            f"{model.spec}: no Dex adapter applied; pass --dex ADAPTER or a Dex adapter or run "
            "directory"
        )
    selection = selected_heads(model.model)
    pairs = [(layer, head) for layer, heads in sorted(selection.heads.items()) for head in heads]
    return pairs[:limit]


@takes_settings(EffectiveSettings)
def run(models: Sequence[EvalModel], settings: EffectiveSettings, quiet: bool) -> dict[str, Any]:
    """Effective-attention estimates and their agreement for each model's adapted heads
    (``settings``, or its fields by name: ``run(models, windows=3)``)."""
    from diffattn.dex.effective import head_tensors

    docs, results = open_documents(settings, settings.seed)
    for model in models:
        heads = adapted_heads(model, settings.max_heads)
        pieces = model_windows(model, docs, settings.seq_len, settings.max_tokens)
        pieces = pieces[: settings.windows]
        rows = []
        for layer, head in progress(heads, len(heads), f"effective {model.name}", quiet):
            per_window = []
            for piece in pieces:
                ids = torch.tensor([piece], device=model.device)
                tensors = head_tensors(model.model, ids, layer, head)
                per_window.append(
                    head_report(tensors, settings.steps, settings.lr, settings.optimizer)
                )
            mean = {k: sum(w[k] for w in per_window) / len(per_window) for k in per_window[0]}
            rows.append({"layer": layer, "head": head, "windows": len(per_window), **mean})
        results["models"][model.name] = {"heads": rows}
    return results


def plot_agreement(results: dict[str, Any], path: Path) -> Path:
    fig, ax = one_axes()
    for name, r in results["models"].items():
        ax.scatter(
            [h["invisible_share"] for h in r["heads"]],
            [h["pinv_vs_optim_rel"] for h in r["heads"]],
            label=name,
        )
    return save_axes(
        fig,
        ax,
        path,
        "Effective attention: pinv vs optimisation (Dex App. F.3)",
        "||A(I − VV⁺)|| / ||A||  (part of A that V cannot see)",
        "||X_optim − X_pinv|| / ||X_pinv||",
        grid=False,
    )


def report(results: dict[str, Any]) -> str:
    rows = [
        (
            name,
            f"{h['layer']}.{h['head']}",
            h["keys"],
            h["head_dim"],
            h["pinv_vs_optim_rel"],
            h["pinv_vs_optim_row_cosine"],
            h["nearest_vs_optim_rel"],
            h["residual_pinv"],
            h["residual_optim"],
            h["invisible_share"],
        )
        for name, r in results["models"].items()
        for h in r["heads"]
    ]
    return (
        "## Effective attention estimates (Dex App. F.3)\n\n"
        + markdown_table(
            [
                "model",
                "layer.head",
                "keys S",
                "head d",
                "pinv vs optim",
                "row cosine",
                "nearest vs optim",
                "residual pinv",
                "residual optim",
                "invisible share",
            ],
            rows,
        )
        + "\nRelative Frobenius differences and residuals ||XV − O'||/||O'||, means over "
        "windows. When keys outnumber the head width, pinv and optimisation differ by "
        "A(I − VV⁺) (the invisible share), which changes no output.\n"
    )


def figures(results: dict[str, Any], out: Path) -> list[Path]:
    return [plot_agreement(results, out / "effective_agreement.png")]


def main(args: Any) -> int:
    return command_main(args, NAME, EffectiveSettings, run, report, figures)
