"""``diffattn dex select|train|merge|compare``: Dex (Kong, Jang, Kwak) on a pretrained model.

MODEL is a Hugging Face model directory, a diffattn model directory, or ``smollm2``. Exit
codes: 0 done; 1 the run diverged; 2 an invalid setting or unsupported model (one message).

Each sub-command's options are declared once, as the fields of its settings class
(:class:`SelectSettings`, :class:`MergeSettings`, :class:`CompareSettings`, and the library's
:class:`~diffattn.dex.train.DexTrainOptions` for ``train``; all but ``merge`` share the
library's :class:`~diffattn.dex.train.DexModelSettings`, here ``ModelSettings``), and each
sub-command runs from its settings object (:func:`select`, :func:`train`, :func:`merge`,
:func:`compare`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Literal

from diffattn.dex.selection import DEFAULT_METHOD
from diffattn.dex.train import CALIBRATION_BATCHES, DexTrainOptions
from diffattn.dex.train import DexModelSettings as ModelSettings
from diffattn.settings import Settings, like, setting

DESCRIPTION = (
    "Dex, the differential extension of a pretrained decoder: select heads (§3.2), train "
    "with the App. F.1 recipe (AdamW, cosine, warm-up 3%, lr 1e-4), merge into a plain "
    "checkpoint, or compare against LoRA and full fine-tuning on the same data."
)

COMPARE_STEPS = 200
"""Optimizer steps per method of ``dex compare`` when neither ``--steps`` nor the recipe
gives them."""


def _k(value: float) -> int | float:
    """``--k``: a whole number of heads (1 or more) as an int, else a share of the heads."""
    return int(value) if float(value).is_integer() and value >= 1 else float(value)


@dataclass(frozen=True, kw_only=True)
class SelectSettings(ModelSettings):
    """The settings of ``diffattn dex select``."""

    method: Literal["entropy", "importance"] = setting(DEFAULT_METHOD)
    k: int | float | None = setting(
        None, type=float, parse=_k, help="heads per layer (default: half)"
    )
    order: Literal["high", "low"] | None = setting(None)
    batches: int = setting(CALIBRATION_BATCHES, help="calibration batches")
    out: str | None = setting(None, help="JSON file for the selection")


@dataclass(frozen=True, kw_only=True)
class MergeSettings(Settings):
    """The settings of ``diffattn dex merge``."""

    adapter: str = setting(positional=True, help="adapter directory or dex train run directory")
    model: str = like(
        ModelSettings, "model", help="the pretrained model the adapter was trained on"
    )
    out: str = setting(required=True, help="output model directory (absent or empty)")
    overwrite: bool = setting(False, help="replace a non-empty --out as a whole")


@dataclass(frozen=True, kw_only=True)
class CompareSettings(ModelSettings):
    """The settings of ``diffattn dex compare``."""

    out: str = setting("runs/dex-compare", help="output directory")
    steps: int | None = setting(None, help=f"optimizer steps per method (default {COMPARE_STEPS})")
    methods: tuple[str, ...] | None = setting(
        None, nargs="+", parse=tuple, help="subset of dex lora8 lora32 ft (default: all)"
    )
    recipe: str | None = setting(
        None,
        help="YAML with steps, methods, set and benchmarks (mc, needle, icl on every model), "
        "e.g. configs/dex/smollm2.yaml; --steps, --methods and --set override it",
    )
    overwrite: bool = like(MergeSettings, "overwrite")


VERBS: dict[str, tuple[type[Settings], str]] = {
    "select": (SelectSettings, "score and select heads (entropy or importance)"),
    "train": (DexTrainOptions, "train Dex with the diffattn trainer"),
    "merge": (MergeSettings, "fold a trained adapter into W_O, save a plain model"),
    "compare": (CompareSettings, "Dex vs LoRA-8/32 vs full fine-tuning"),
}
"""Each sub-command: its settings and its one-line help."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``dex`` sub-verbs to ``parser``."""
    verbs = parser.add_subparsers(dest="dex_verb", required=True, metavar="DEX_VERB")
    for verb, (settings, help_text) in VERBS.items():
        settings.add_arguments(verbs.add_parser(verb, help=help_text))


def run(args: argparse.Namespace) -> int:
    """Run one ``dex`` sub-verb; invalid settings raise ValueError (exit code 2)."""
    from diffattn.train import TrainingDiverged

    settings = VERBS[args.dex_verb][0].from_args(args)
    command = {"select": select, "train": train, "merge": merge, "compare": compare}
    try:
        return command[args.dex_verb](settings)
    except TrainingDiverged as error:
        print(f"diffattn dex {args.dex_verb}: error: {error}", file=sys.stderr)
        return 1


def select(settings: SelectSettings) -> int:
    """``dex select``: score and select the heads, print them and save them to ``out``."""
    from diffattn.dex import train as dex_train

    selection = dex_train.select_run(
        settings.model,
        settings.method,
        settings.k,
        settings.order,
        settings.out,
        settings.overrides,
        batches=settings.batches,
        progress=settings.progress,
    )
    print(selection.format_table())
    if settings.out:
        print(f"saved: {settings.out}")
    return 0


def train(settings: DexTrainOptions) -> int:
    """``dex train``: train Dex, print the heads, the λs and the held-out loss."""
    from diffattn.dex import train as dex_train

    print(dex_train.format_result(dex_train.train_dex(settings)))
    return 0


def merge(settings: MergeSettings) -> int:
    """``dex merge``: fold the adapter into W_O and save a plain model to ``out``."""
    from diffattn.dex import train as dex_train

    out = dex_train.merge_run(
        settings.adapter, settings.model, settings.out, overwrite=settings.overwrite
    )
    print(f"merged model: {out}")
    return 0


def compare(settings: CompareSettings) -> int:
    """``dex compare``: Dex, LoRA and full fine-tuning on the same data; the recipe's
    ``steps``, ``methods`` and ``set`` apply where the command line gives none."""
    from diffattn.dex_compare import compare_methods, load_recipe

    recipe = load_recipe(settings.recipe) if settings.recipe else {"set": [], "benchmarks": None}
    benchmarks = recipe["benchmarks"]
    if benchmarks is not None:
        benchmarks.quiet = not settings.progress
    steps = settings.steps
    if steps is None:
        steps = recipe.get("steps") or COMPARE_STEPS
    compare_methods(
        settings.model,
        settings.out,
        steps,
        overrides=[*recipe["set"], *settings.overrides],
        methods=settings.methods or recipe.get("methods"),
        progress=settings.progress,
        overwrite=settings.overwrite,
        benchmarks=benchmarks,
    )
    return 0
