"""Causal load balance of context parallelism: each rank's share of a row's attention work.

    python scripts/cp_balance.py [--seq-len N] [--degrees 2 4 8] [--png FILE]

Under a causal mask the query at position p reads p + 1 keys, so a row's attention work is
N(N + 1)/2 query-key pairs. Cutting the row into C contiguous slices gives the last rank
(2C − 1) times the first one's work; diffattn's layout
(:class:`diffattn.attention.context_parallel.ChunkLayout`) cuts it into 2C chunks and gives rank
r chunks r and 2C − 1 − r, so every rank reads the same number of pairs when the chunks are
whole. The script prints each rank's share of the pairs for both layouts and the ratio of the
busiest rank to the mean (what the step waits for), and draws the causal mask of a short row
coloured by the rank that owns each query (matplotlib).

Counts, not timings: it runs no model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from diffattn.attention.context_parallel import ChunkLayout


def contiguous_positions(seq_len: int, degree: int, rank: int) -> torch.Tensor:
    """The positions of rank ``rank`` when the row is cut into ``degree`` contiguous slices."""
    size = seq_len // degree
    return torch.arange(rank * size, (rank + 1) * size)


def balanced_positions(seq_len: int, degree: int, rank: int) -> torch.Tensor:
    """The positions of rank ``rank`` in diffattn's two-chunk layout."""
    return ChunkLayout(seq_len, degree, rank).positions()


LAYOUTS = {"contiguous": contiguous_positions, "two chunks (diffattn)": balanced_positions}


def shares(seq_len: int, degree: int, layout) -> list[float]:
    """Each rank's share of the row's causal query-key pairs (position p reads p + 1 keys)."""
    total = seq_len * (seq_len + 1) / 2
    return [float((layout(seq_len, degree, r) + 1).sum()) / total for r in range(degree)]


def table(seq_len: int, degrees: list[int]) -> str:
    lines = [
        f"N = {seq_len}: each rank's share of the causal query-key pairs",
        "| CP | layout | shares by rank | busiest / mean |",
        "|---|---|---|---|",
    ]
    for degree in degrees:
        for name, layout in LAYOUTS.items():
            got = shares(seq_len, degree, layout)
            listed = " ".join(f"{s:.4f}" for s in got)
            lines.append(f"| {degree} | {name} | {listed} | {max(got) * degree:.4f} |")
    return "\n".join(lines)


def draw(path: Path, seq_len: int = 32, degree: int = 4) -> None:
    """The causal mask of a row of ``seq_len`` tokens, each query row coloured by its rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    colours = ListedColormap(["#ffffff", "#4c72b0", "#dd8452", "#55a868", "#c44e52"][: degree + 1])
    figure, axes = plt.subplots(1, 2, figsize=(9, 4.9))
    for ax, (name, layout) in zip(axes, LAYOUTS.items(), strict=True):
        owner = torch.zeros(seq_len, seq_len)
        for rank in range(degree):
            for p in layout(seq_len, degree, rank).tolist():
                owner[p, : p + 1] = rank + 1
        ax.imshow(owner.numpy(), cmap=colours, vmin=0, vmax=degree, interpolation="nearest")
        got = shares(seq_len, degree, layout)
        ax.set_title(f"{name}\nbusiest rank / mean = {max(got) * degree:.2f}", fontsize=10)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        for rank in range(degree):
            ax.plot([], [], "s", color=colours(rank + 1), label=f"rank {rank}: {got[rank]:.1%}")
        ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    figure.suptitle(f"Causal attention work per rank, CP = {degree}, N = {seq_len}")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--degrees", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--png", type=Path, default=None, help="write the mask figure here")
    args = parser.parse_args(argv)
    print(table(args.seq_len, args.degrees))
    if args.png is not None:
        draw(args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
