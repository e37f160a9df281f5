"""Fits, shares and the figure of a scaling sweep: ``results.json``, ``report.md``, ``scaling.png``.

For every arm, L(x) = a·x^−α + c is fitted to its points (:mod:`.fit`); for every arm other
than the baseline (DIFF V1, DIFF V2, another type, an ablation) the share of x it needs to
match the Transformer is read off the two fits at each measured Transformer x and, the other
way round, at each measured x of its own, next to DIFF V1's reported shares (§3.2: 62.2% and
59.5% of the parameters, 63.7% of the tokens). Arms are named and coloured by their type's
declaration (:mod:`diffattn.compare.arms`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from diffattn.compare.arms import REFERENCE, colours, title_of
from diffattn.scaling.fit import PowerLawFit, Share, fit_power_law, share_needed
from diffattn.scaling.points import Point

PAPER_SHARES = {
    "params": [
        "6.8B DIFF matches an 11B Transformer: 62.2% of the parameters",
        "7.8B DIFF matches a 13.1B Transformer: 59.5% of the parameters",
    ],
    "tokens": ["DIFF on 160B tokens matches the Transformer on 251B: 63.7% of the tokens"],
}
"""DIFF V1 §3.2 (Fig 3), for DIFF V1 against the Transformer at 830M–13.1B / 3B models."""
UNIT = {"params": "N", "tokens": "D"}


def fit_all(points: list[Point], axis: str) -> dict[str, Any]:
    """Fits per arm and shares per arm other than the baseline (ValueError when a fit is
    impossible)."""
    by_type: dict[str, list[Point]] = {}
    for point in points:
        by_type.setdefault(point.attention, []).append(point)
    if REFERENCE not in by_type:
        raise ValueError(f"no Transformer ({REFERENCE}) points: the shares need its fit")
    if len(by_type) < 2:
        raise ValueError(f"no points of another arm: give {REFERENCE} and at least one other")
    fits: dict[str, PowerLawFit] = {}
    for attention, mine in by_type.items():
        mine.sort(key=lambda p: p.x)
        what = f"{title_of(attention)} ({len(mine)} points)"
        fits[attention] = fit_power_law([p.x for p in mine], [p.loss for p in mine], what)
    shares: dict[str, list[Share]] = {}
    reference = fits[REFERENCE]
    for attention in by_type:
        if attention == REFERENCE:
            continue
        rows = [
            share_needed(reference, fits[attention], p.x, "transformer") for p in by_type[REFERENCE]
        ]
        rows += [share_needed(reference, fits[attention], p.x, "diff") for p in by_type[attention]]
        shares[attention] = rows
    return {"by_type": by_type, "fits": fits, "shares": shares}


def _size(x: float, axis: str) -> str:
    if not math.isfinite(x):
        return "∞"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _pm(value: float, error: float | None) -> str:
    return f"{value:.4g}" + (f" ± {error:.2g}" if error is not None else " (exact fit)")


def _share_cell(share: Share) -> str:
    if not math.isfinite(share.share):
        return "not reached (DIFF's floor c is above this loss)"
    text = f"{100 * share.share:.1f}%"
    if share.low is not None and share.high is not None:
        text += f" [{100 * share.low:.1f}, {100 * share.high:.1f}]"
    return text


def render(fitted: dict[str, Any], axis: str, count: str, header: str = "") -> str:
    """The report's markdown: points, fits, shares next to the paper's."""
    unit = UNIT[axis]
    what = f"{count.replace('_', '-')} parameters" if axis == "params" else "training tokens"
    lines = [header.rstrip(), ""] if header else []
    lines += [f"## Points ({unit} = {what}; loss = validation loss, nats)", ""]
    lines += ["| model | " + unit + " | loss | from |", "|---|---|---|---|"]
    for attention, mine in fitted["by_type"].items():
        for p in mine:
            lines.append(f"| {title_of(attention)} | {p.x:,.0f} | {p.loss:.4f} | `{p.source}` |")
    lines += ["", f"## Fits: L({unit}) = a·{unit}^−α + c (±1σ)", ""]
    lines += ["| model | points | a | α | c | rmse | note |", "|---|---|---|---|---|---|---|"]
    for attention, fit in fitted["fits"].items():
        note = []
        if fit.covariance is None:
            note.append("as many points as parameters: no uncertainty")
        if fit.at_bound:
            note.append("at a bound: " + ", ".join(fit.at_bound))
        lines.append(
            f"| {title_of(attention)} | {fit.points} | {_pm(fit.a, fit.a_err)} | "
            f"{_pm(fit.alpha, fit.alpha_err)} | {_pm(fit.c, fit.c_err)} | {fit.rmse:.2g} | "
            f"{'; '.join(note)} |"
        )
    lines += ["", f"## Share of {unit} DIFF needs to match the Transformer", ""]
    lines += [
        f"{unit}_D / {unit}_T where both fits give the same loss; [16th, 84th] percentiles "
        "over parameters sampled from the fits' covariances.",
        "",
        f"| DIFF | given | {unit}_T (Transformer) | {unit}_D (DIFF) | share |",
        "|---|---|---|---|---|",
    ]
    for attention, rows in fitted["shares"].items():
        for row in rows:
            given = "Transformer size" if row.direction == "transformer" else "DIFF size"
            lines.append(
                f"| {title_of(attention)} | {given} | {_size(row.transformer, axis)} "
                f"| {_size(row.diff, axis)} | {_share_cell(row)} |"
            )
    lines += ["", "Paper (DIFF V1 §3.2, Fig 3, DIFF V1 vs Transformer):", ""]
    lines += [f"- {text}" for text in PAPER_SHARES[axis]]
    return "\n".join(lines) + "\n"


def plot(fitted: dict[str, Any], axis: str, path: Path) -> Path:
    """Loss against x (log scale): points and fitted curves per arm, in its declaration's
    colour (:func:`diffattn.compare.arms.colours`)."""
    import numpy as np

    from diffattn.eval.common import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    xs = [p.x for mine in fitted["by_type"].values() for p in mine]
    grid = np.geomspace(min(xs) / 1.5, max(xs) * 1.5, 200)
    colour_of = colours(fitted["by_type"])
    for attention, mine in fitted["by_type"].items():
        color = colour_of[attention]
        fit = fitted["fits"][attention]
        label = f"{title_of(attention)}: {fit.a:.3g}·x^−{fit.alpha:.3g} + {fit.c:.3g}"
        ax.plot(grid, fit.predict(grid), color=color, label=label)
        ax.scatter([p.x for p in mine], [p.loss for p in mine], color=color, zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel("parameters" if axis == "params" else "training tokens")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title("Scaling (DIFF V1 Fig 3" + ("a)" if axis == "params" else "b)"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def write(
    out: Path,
    fitted: dict[str, Any],
    axis: str,
    count: str,
    settings: dict[str, Any],
    header: str = "",
) -> tuple[Path, Path, str]:
    """``report.md``, ``results.json`` and ``scaling.png`` in ``out``; returns the report text."""
    from diffattn.fileio import write_json

    out.mkdir(parents=True, exist_ok=True)
    figure = plot(fitted, axis, out / "scaling.png")
    text = render(fitted, axis, count, header) + f"\n![scaling]({figure.name})\n"
    (out / "report.md").write_text(text, encoding="utf-8")
    record = {
        "axis": axis,
        "count": count,
        "settings": settings,
        "points": [p.to_dict() for mine in fitted["by_type"].values() for p in mine],
        "fits": {k: v.to_dict() for k, v in fitted["fits"].items()},
        "shares": {k: [s.to_dict() for s in v] for k, v in fitted["shares"].items()},
        "paper": PAPER_SHARES[axis],
    }
    write_json(out / "results.json", _finite(record))
    return out / "report.md", out / "results.json", text


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


__all__ = ["PAPER_SHARES", "fit_all", "plot", "render", "write"]
