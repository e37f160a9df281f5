"""The training command line: ``diffattn train CONFIG`` and ``python -m diffattn.train CONFIG``.

``CONFIG [--steps N] [--out DIR] [--resume [STEP] | --resume-fallback | --overwrite] [--set k=v ...]
[--device D] [--quiet]``; the
same arguments under ``torchrun``. ``diffattn.commands.train`` exposes these to ``diffattn``.

Exit codes: 0 done; 1 the run diverged (NaN/Inf loss, weights of the last good step kept);
2 an invalid setting (nothing written); 128 + signal number when SIGINT/SIGTERM stopped the
run after saving a checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from diffattn.settings import Settings, setting

DESCRIPTION = (
    "Train a baseline, DIFF V1 or DIFF V2 language model from a YAML recipe; runs in one "
    "process or under torchrun (DDP or FSDP2), checkpoints atomically and resumes exactly."
)

QUIET_WARNINGS = (
    r"DTensor random operators may not have complete support",
    r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to "
    r"(save|load) in a single process",
)
"""The messages (regular expressions, matched at their start) of torch's warnings that
``--quiet`` leaves out: FSDP2's when shards that are then overwritten (a resumed run's, or
``fsdp_init: rank0``'s) are first drawn on a CPU mesh, and DCP's when one process saves or
loads sharded checkpoints, as it is told to."""


@contextlib.contextmanager
def quiet_warnings(quiet: bool) -> Iterator[None]:
    """Within the block, with ``quiet``, the warnings of :data:`QUIET_WARNINGS` are ignored;
    every other warning, and everything without ``quiet``, is shown as before."""
    with warnings.catch_warnings():
        if quiet:
            for message in QUIET_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


def recipe_overrides(help_text: str) -> Any:
    """The repeatable ``--set KEY=VALUE`` recipe override, as the setting ``overrides:
    Sequence[str]`` of a command's settings class (collected in ``args.overrides``)."""
    return setting((), flag="--set", action="append", metavar="KEY=VALUE", help=help_text)


def add_set_option(parser: argparse.ArgumentParser, help_text: str) -> None:
    """Add the ``--set`` option of :func:`recipe_overrides` to ``parser`` alone."""
    options = dataclasses.make_dataclass(
        "SetOption",
        [("overrides", Sequence[str], recipe_overrides(help_text))],
        bases=(Settings,),
        frozen=True,
    )
    options.add_arguments(parser)


def _resume_step(text: str) -> int:
    """``--resume STEP``: a positive step number. Anything else after ``--resume`` is most
    likely the recipe, which argparse hands to ``--resume`` when it follows it: the message
    shows the order that works."""
    if text.isdigit() and int(text) >= 1:
        return int(text)
    message = f"expected a checkpoint's step (a positive integer), got {text!r}"
    if not text.isdigit():
        message += (
            f"; put the recipe first: diffattn train {text} [OPTIONS] --resume [STEP] "
            "(or write --resume=STEP)"
        )
    raise argparse.ArgumentTypeError(message)


@dataclass(frozen=True)
class TrainSettings(Settings):
    """The options of ``diffattn train``, each declared once."""

    config: str = setting(
        positional=True,
        help="YAML recipe: a path (configs/tiny.yaml) or the name of a shipped one (tiny, "
        "paper-3b, compare-100m, ...)",
    )
    steps: int | None = setting(None, help="optimizer steps to reach (sets steps)")
    out: str | None = setting(None, help="run directory (default: runs/<recipe name>)")
    resume: int | bool = setting(
        False,
        nargs="?",
        const=True,
        type=_resume_step,
        metavar="STEP",
        help="continue from the newest checkpoint in --out, or from the checkpoint of STEP "
        "(the newer ones are moved to OUT/superseded/, not deleted)",
    )
    """``False``: a fresh run; ``True``: from the newest checkpoint; a step: from that one."""
    resume_fallback: bool = setting(
        False,
        help="like --resume, but when the newest checkpoint is cut off or unreadable, "
        "continue from the newest valid one (says which, and what was skipped)",
    )
    auto_resume: bool = setting(
        False,
        help="resume when --out holds a checkpoint, else start fresh: one command line for "
        "first launch and restarts (torchrun --max-restarts)",
    )
    overwrite: bool = setting(
        False, help="replace a non-empty --out that holds another run (nothing of it is kept)"
    )
    overrides: Sequence[str] = recipe_overrides(
        "override a recipe entry, value parsed as YAML (e.g. --set optim.lr=3e-4 "
        "--set model.attention=diff_v1); repeatable"
    )
    device: Literal["auto", "cpu", "cuda"] | None = setting(None, help="sets device")
    quiet: bool = setting(False, help="no progress bar or messages (errors still shown)")


add_arguments = TrainSettings.add_arguments
"""Add the options of ``diffattn train`` to a parser."""


def _has_checkpoint(out: Path) -> bool:
    """Whether ``out`` holds a checkpoint to resume from (every rank sees the same answer:
    nothing is written before the run's plan is made)."""
    from diffattn.train.checkpoint import CHECKPOINTS_DIRNAME, latest_checkpoint

    return latest_checkpoint(out / CHECKPOINTS_DIRNAME) is not None


def run(args: argparse.Namespace) -> int:
    """Run ``diffattn train`` on a parsed command line; returns the exit code."""
    return run_settings(TrainSettings.from_args(args))


def run_settings(settings: TrainSettings) -> int:
    """Run ``diffattn train`` with ``settings``; returns the exit code."""
    from diffattn.fileio import CheckpointError
    from diffattn.recipes import resolve_recipe
    from diffattn.train import ConfigError, TrainingDiverged, load_config, shutdown, train

    def error(message: str) -> None:
        print(f"diffattn train: error: {message}", file=sys.stderr, flush=True)

    overrides = list(settings.overrides)
    if settings.steps is not None:
        overrides.append(f"steps={settings.steps}")
    if settings.device is not None:
        overrides.append(f"device={settings.device}")
    try:
        recipe = resolve_recipe(settings.config)
    except FileNotFoundError as missing:
        error(f"config: {missing}")
        return 2
    out = Path(settings.out) if settings.out else Path("runs") / recipe.stem
    if settings.resume is not False and settings.resume is not True and settings.resume_fallback:
        error("--resume STEP names one checkpoint; --resume-fallback chooses among the newest")
        return 2
    resume = (
        settings.resume
        or settings.resume_fallback
        or (settings.auto_resume and _has_checkpoint(out))
    )
    finished = False
    try:
        notes: list[str] = []
        config = load_config(recipe, overrides, notes)
        for note in notes if _is_main() else ():
            print(f"diffattn train: note: {note}", file=sys.stderr, flush=True)
        with quiet_warnings(settings.quiet):
            result = train(
                config,
                out,
                resume=resume,
                progress=not settings.quiet,
                overwrite=settings.overwrite,
                resume_fallback=settings.resume_fallback,
            )
        finished = True
    except (ConfigError, CheckpointError) as exc:
        error(str(exc))
        return 2
    except TrainingDiverged as exc:
        error(str(exc))
        return 1
    finally:
        # every rank gets here together only after a run that finished; on an error a peer
        # may be blocked in another collective, so nothing may wait for it
        shutdown(wait=finished)
    if not settings.quiet and _is_main():
        print(
            f"diffattn train: step {result.step}, loss {result.final.get('loss', float('nan')):.4f}"
            + (f", val_loss {result.final['val_loss']:.4f}" if "val_loss" in result.final else "")
            + f", checkpoint {result.checkpoint}"
        )
    return result.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m diffattn.train ARGV``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m diffattn.train", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _is_main() -> bool:
    from diffattn.train.distributed import read_env

    try:
        return read_env().is_main
    except ValueError:
        return True
