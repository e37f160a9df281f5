"""``diffattn dex select|train|merge|compare``: Dex (Kong, Jang, Kwak) on a pretrained model.

MODEL is a Hugging Face model directory, a diffattn model directory, or ``smollm2``. Exit
codes: 0 done; 1 the run diverged; 2 an invalid setting or unsupported model (one message).
"""

from __future__ import annotations

import argparse
import sys

from diffattn.train.cli import add_set_option

DESCRIPTION = (
    "Dex, the differential extension of a pretrained decoder: select heads (§3.2), train "
    "with the App. F.1 recipe (AdamW, cosine, warm-up 3%, lr 1e-4), merge into a plain "
    "checkpoint, or compare against LoRA and full fine-tuning on the same data."
)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="HF model directory, diffattn model directory or smollm2")
    add_set_option(
        parser, "override a training-config entry, e.g. --set seq_len=128 --set data.max_bytes=1e6"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``dex`` sub-verbs to ``parser``."""
    verbs = parser.add_subparsers(dest="dex_verb", required=True, metavar="DEX_VERB")

    select = verbs.add_parser("select", help="score and select heads (entropy or importance)")
    _add_common(select)
    select.add_argument("--method", choices=("entropy", "importance"), default="entropy")
    select.add_argument("--k", type=float, default=None, help="heads per layer (default: half)")
    select.add_argument("--order", choices=("high", "low"), default=None)
    select.add_argument("--batches", type=int, default=2, help="calibration batches")
    select.add_argument("--out", default=None, help="JSON file for the selection")

    train = verbs.add_parser("train", help="train Dex with the diffattn trainer")
    _add_common(train)
    train.add_argument("--out", required=True, help="run directory")
    train.add_argument(
        "--heads", default="entropy", help="entropy (default), importance, all, or a JSON file"
    )
    train.add_argument("--steps", type=int, default=100, help="optimizer steps")
    train.add_argument("--lambda-init", default="exp", help="exp (default) or a number")
    train.add_argument("--anneal-steps", type=int, default=None, help="T of Eq.4 (default half)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out")
    train.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out (another run)"
    )

    merge = verbs.add_parser("merge", help="fold a trained adapter into W_O, save a plain model")
    merge.add_argument("adapter", help="adapter directory or dex train run directory")
    merge.add_argument("model", help="the pretrained model the adapter was trained on")
    merge.add_argument("--out", required=True, help="output model directory (absent or empty)")
    merge.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out as a whole"
    )

    compare = verbs.add_parser("compare", help="Dex vs LoRA-8/32 vs full fine-tuning")
    _add_common(compare)
    compare.add_argument("--out", default="runs/dex-compare", help="output directory")
    compare.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per method (default 200)"
    )
    compare.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="subset of dex lora8 lora32 ft (default: all)",
    )
    compare.add_argument(
        "--recipe",
        default=None,
        help="YAML with steps, methods, set and benchmarks (mc, needle, icl on every model), "
        "e.g. configs/dex/smollm2.yaml; --steps, --methods and --set override it",
    )
    compare.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out as a whole"
    )


def _k(value: float | None) -> int | float | None:
    if value is None:
        return None
    return int(value) if float(value).is_integer() and value >= 1 else float(value)


def run(args: argparse.Namespace) -> int:
    """Run one ``dex`` sub-verb; invalid settings raise ValueError (exit code 2)."""
    from diffattn.train import TrainingDiverged

    try:
        return _run(args)
    except TrainingDiverged as error:
        print(f"diffattn dex {args.dex_verb}: error: {error}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from diffattn.dex import train as dex_train

    if args.dex_verb == "select":
        selection = dex_train.select_run(
            args.model,
            args.method,
            _k(args.k),
            args.order,
            args.out,
            args.overrides,
            batches=args.batches,
            progress=not args.quiet,
        )
        print(selection.format_table())
        if args.out:
            print(f"saved: {args.out}")
        return 0
    if args.dex_verb == "train":
        result = dex_train.train_dex(
            dex_train.DexTrainOptions(
                model=args.model,
                out=args.out,
                heads=args.heads,
                steps=args.steps,
                lambda_init=args.lambda_init,
                anneal_steps=args.anneal_steps,
                overrides=list(args.overrides),
                resume=args.resume,
                progress=not args.quiet,
                overwrite=args.overwrite,
            )
        )
        print(result.heads.format_table())
        print(dex_train.format_lambdas(result.lambdas))
        print(
            f"held-out loss: before {result.loss_before:.4f}, after {result.loss_after:.4f} "
            f"({result.step} steps, {result.elapsed_s:.1f} s, "
            f"{result.trainable_parameters:,} of {result.parameters:,} parameters trained)"
        )
        print(f"adapter: {result.adapter}\ncheckpoint: {result.checkpoint}")
        return 0
    if args.dex_verb == "merge":
        out = dex_train.merge_run(args.adapter, args.model, args.out, overwrite=args.overwrite)
        print(f"merged model: {out}")
        return 0
    from diffattn.dex_compare import compare_methods, load_recipe

    recipe = load_recipe(args.recipe) if args.recipe else {"set": [], "benchmarks": None}
    benchmarks = recipe["benchmarks"]
    if benchmarks is not None:
        benchmarks.quiet = args.quiet
    compare_methods(
        args.model,
        args.out,
        args.steps if args.steps is not None else recipe.get("steps") or 200,
        overrides=[*recipe["set"], *args.overrides],
        methods=args.methods or recipe.get("methods"),
        progress=not args.quiet,
        overwrite=args.overwrite,
        benchmarks=benchmarks,
    )
    return 0
