"""``diffattn eval hessian``: spectra of the Hessian's dominant eigenvalue over batches (Dex
§2.4, Fig 7, following Park & Kim's "How do vision transformers work?").

For each of ``--batches`` batches of held-out windows, power iteration on Hessian-vector
products (double backward through the loss) finds the eigenvalue of largest magnitude of that
batch's loss Hessian with respect to the chosen parameters. That eigenvalue can be negative; a
high share of negative ones marks a non-convex loss landscape, which Dex §2.4 reports to be
much rarer for DIFF than for the Transformer. The figure is the histogram of those eigenvalues
per model (``hessian_spectra.png``).

Attention runs with explicit matrix products for the measurement (fused kernels have no second
derivative): the ``reference`` backend for diffattn models, ``eager`` for Hugging Face ones.
Power iteration stops when the Rayleigh quotient changes by less than ``--tol`` (relative) or
after ``--iters`` steps; the number of steps each batch took is recorded. Each product costs
about two backward passes, so this is for small models: a 1.5M-parameter model at 8 × 256
tokens takes seconds per batch on a CPU.

Results per model: ``eigenvalues`` (one per batch), ``iterations``, ``negative_share``,
``mean``, ``min``, ``max``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffattn.eval.common import (
    CommonOptions,
    EvalModel,
    command_main,
    markdown_table,
    one_axes,
    save_axes,
)
from diffattn.eval.text import WINDOW_BOUNDS, DataSettings, measure_windows, padded_batches
from diffattn.settings import like, setting, shared, takes_settings

NAME = "hessian"
HELP = "dominant Hessian eigenvalue per batch and its spectrum over batches (Dex §2.4, Fig 7)"
PARAMETER_SETS = ("all", "attention")


@dataclass(frozen=True)
class HessianSettings(DataSettings):
    """The settings of ``diffattn eval hessian`` (and of :func:`run`). From Python the batch
    holds 4 windows by default (Hessian-vector products are heavy); the command's
    ``--batch-size`` defaults to 8, as every experiment's."""

    seq_len: int = like(DataSettings, "seq_len", 256)
    max_tokens: int = like(DataSettings, "max_tokens", 16_384)
    batches: int = setting(16, min=1, help="batches (one eigenvalue each)")
    iters: int = setting(30, help="power-iteration steps at most")
    tol: float = setting(1e-3, help="relative convergence tolerance")
    params: str = setting(
        "all",
        choices=PARAMETER_SETS,
        error=f"--params must be one of {PARAMETER_SETS}, got {{params!r}}",
        help="all parameters, or those of the attention modules only",
    )
    batch_size: int = shared(CommonOptions, "batch_size", 4, error=WINDOW_BOUNDS)
    seed: int = shared(CommonOptions, "seed")


add_arguments = HessianSettings.add_arguments


def dominant_eigenvalue(
    loss_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.Tensor],
    iters: int = HessianSettings.iters,
    tol: float = HessianSettings.tol,
    generator: torch.Generator | None = None,
) -> tuple[float, int]:
    """The Hessian eigenvalue of largest magnitude of ``loss_fn()`` in ``params`` (power
    iteration on Hessian-vector products) and the steps it took."""
    if iters < 1 or tol <= 0:
        raise ValueError(f"iters must be at least 1 and tol positive, got {iters}, {tol}")
    loss = loss_fn()
    grads = torch.autograd.grad(loss, params, create_graph=True)
    vector = [torch.randn(p.shape, generator=generator).to(p) for p in params]
    norm = torch.sqrt(sum((v * v).sum() for v in vector))
    vector = [v / norm for v in vector]
    eigenvalue, steps = math.nan, 0
    for steps in range(1, iters + 1):
        products = torch.autograd.grad(grads, params, grad_outputs=vector, retain_graph=True)
        rayleigh = float(sum((h * v).sum() for h, v in zip(products, vector, strict=True)))
        norm = torch.sqrt(sum((h * h).sum() for h in products))
        if float(norm) == 0.0:
            return 0.0, steps
        vector = [h.detach() / norm for h in products]
        converged = not math.isnan(eigenvalue) and abs(rayleigh - eigenvalue) <= tol * abs(rayleigh)
        eigenvalue = rayleigh
        if converged:
            break
    return eigenvalue, steps


def chosen_parameters(model: torch.nn.Module, which: str) -> list[torch.nn.Parameter]:
    """``all`` trainable floating parameters, or those of modules named like attention."""
    named = [
        (n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()
    ]
    if which == "attention":
        named = [
            (n, p) for n, p in named if any(k in n for k in ("attn", "attention", "self_attn"))
        ]
    if not named:
        raise ValueError(f"no trainable parameters to differentiate ({which})")
    return [p for _, p in named]


@contextlib.contextmanager
def explicit_attention(model: torch.nn.Module):
    """Run attention with explicit matrix products inside the block: fused kernels (SDPA,
    flash) have no second derivative. diffattn models use the ``reference`` backend, Hugging
    Face models ``attn_implementation="eager"``; both are restored afterwards."""
    inner = getattr(model, "model", model)
    if hasattr(inner, "set_backend"):
        before = inner.backend
        inner.set_backend("reference")
        try:
            yield
        finally:
            inner.set_backend(before)
        return
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    if before not in (None, "eager") and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
        try:
            yield
        finally:
            model.set_attn_implementation(before)
        return
    yield


def model_spectrum(
    model: EvalModel,
    pieces,
    n_batches: int,
    batch_size: int,
    iters: int,
    tol: float,
    params: str,
    seed: int,
    quiet: bool,
) -> dict[str, Any]:
    from diffattn.probe import eval_mode, token_nll

    chosen = chosen_parameters(model.model, params)
    available = math.ceil(len(pieces) / batch_size)
    if available < n_batches:
        raise ValueError(
            f"{model.name}: only {available} batches of {batch_size} windows in the token "
            f"budget; lower --batches or raise --max-tokens"
        )
    pieces = pieces[: n_batches * batch_size]
    label = f"hessian {model.name}"
    generator = torch.Generator().manual_seed(seed)
    values, steps = [], []
    with eval_mode(model.model), explicit_attention(model.model), torch.enable_grad():
        for _, ids, mask in padded_batches(model, pieces, batch_size, label, quiet):

            def loss_fn(ids=ids, mask=mask):
                logits = model.model(**model.window_inputs(ids, mask)).logits
                nll = token_nll(logits, ids, mask)
                return nll[~torch.isnan(nll)].mean()

            value, taken = dominant_eigenvalue(loss_fn, chosen, iters, tol, generator)
            values.append(value)
            steps.append(taken)
    tensor = torch.tensor(values, dtype=torch.float64)
    return {
        "eigenvalues": values,
        "iterations": steps,
        "negative_share": float((tensor < 0).double().mean()),
        "mean": float(tensor.mean()),
        "min": float(tensor.min()),
        "max": float(tensor.max()),
        "parameters": sum(p.numel() for p in chosen),
    }


@takes_settings(HessianSettings)
def run(models: Sequence[EvalModel], settings: HessianSettings, quiet: bool) -> dict[str, Any]:
    """Dominant Hessian eigenvalue of each of ``batches`` batches, per model (``settings``, or
    its fields by name: ``run(models, batches=4)``)."""

    def spectrum(model: EvalModel, pieces: list[list[int]]) -> dict[str, Any]:
        return model_spectrum(
            model,
            pieces,
            settings.batches,
            settings.batch_size,
            settings.iters,
            settings.tol,
            settings.params,
            settings.seed,
            quiet,
        )

    return measure_windows(models, settings, settings.seed, spectrum)


def plot_spectra(results: dict[str, Any], path: Path) -> Path:
    fig, ax = one_axes()
    for name, r in results["models"].items():
        ax.hist(
            r["eigenvalues"], bins=20, alpha=0.5, label=f"{name} ({r['negative_share']:.0%} < 0)"
        )
    ax.axvline(0.0, color="black", linewidth=0.8)
    return save_axes(
        fig,
        ax,
        path,
        "Hessian max eigenvalue spectra (Dex Fig 7)",
        "dominant Hessian eigenvalue of a batch",
        "batches",
        grid=False,
    )


def report(results: dict[str, Any]) -> str:
    rows = [
        (
            name,
            len(r["eigenvalues"]),
            r["negative_share"],
            r["mean"],
            r["min"],
            r["max"],
            max(r["iterations"]),
        )
        for name, r in results["models"].items()
    ]
    return (
        "## Dominant Hessian eigenvalues over batches (Dex §2.4, Fig 7)\n\n"
        + markdown_table(
            ["model", "batches", "negative share", "mean", "min", "max", "most iterations"], rows
        )
        + "\nOne eigenvalue (largest magnitude, by power iteration) per batch's loss Hessian.\n"
    )


def figures(results: dict[str, Any], out: Path) -> list[Path]:
    return [plot_spectra(results, out / "hessian_spectra.png")]


def main(args: Any) -> int:
    return command_main(args, NAME, HessianSettings, run, report, figures)
