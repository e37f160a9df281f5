"""The ``diffattn`` command line: ``diffattn <verb> ...``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from diffattn.commands.extras import VERB_EXTRAS, add_unavailable, missing_extra

# Verbs implemented in diffattn.commands.<verb> (each has add_arguments(parser) and run(args)).
# Its module and add_arguments import only what the options need, run imports the rest; where an
# extra the options need is missing, the verb is listed with a stand-in that names the extra.
VERBS: tuple[tuple[str, str], ...] = (
    ("compare", "train baseline, DIFF V1 and DIFF V2 the same way and report (the main job)"),
    ("train", "train a model from a YAML recipe (single process or torchrun)"),
    ("generate", "generate text from a model directory, streaming tokens"),
    ("serve", "serve a model over an OpenAI-compatible HTTP API (transformers serve)"),
    ("convert", "convert weights between HF Llama / DiffLlama / GGUF and diffattn"),
    ("dex", "Dex on a pretrained decoder: select heads, train, merge, compare"),
    ("eval", "measure the papers' claims: loss slices, needles, outliers, heads, Hessian"),
    ("lm-eval", "run lm-evaluation-harness with diffattn's models registered (--model diffattn)"),
    ("scaling", "fit loss against model size or tokens, DIFF's share to match (Fig 3)"),
    ("long-context", "length-upsample a corpus, widen a model: context extension (§3.3)"),
)


def _presets_command(args: argparse.Namespace) -> int:
    """Parameter counts per type, and DIFF V2's matched SwiGLU width with the difference
    from the baseline that rounding it to a multiple of 64 leaves (presets.match_v2_params)."""
    from diffattn import presets
    from diffattn.model import count_parameters

    names = [args.name] if args.name else presets.names()
    columns = ("baseline", "diff_v1", "diff_v2", "v2 matched")
    print(f"{'preset':>7} " + " ".join(f"{c:>15}" for c in columns) + " v2 ffn  v2 vs base")
    for name in names:
        counts = [
            count_parameters(presets.get(name, attention=attention))
            for attention in ("baseline", "diff_v1", "diff_v2")
        ]
        matched = presets.get(name, "diff_v2", match_params=True)
        counts.append(count_parameters(matched))
        difference = (counts[-1] - counts[0]) / counts[0]
        print(
            f"{name:>7} "
            + " ".join(f"{c:>15,}" for c in counts)
            + f" {matched.ffn_dim:>6} {difference:>+10.3%}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from diffattn.bench import backends, throughput
    from diffattn.version import __version__

    parser = argparse.ArgumentParser(
        prog="diffattn",
        description="Differential Transformers (DIFF V1, DIFF V2) next to a matched baseline.",
    )
    parser.add_argument("--version", action="version", version=f"diffattn {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    for verb, module, help_text, description in (
        (
            "bench",
            throughput,
            "throughput and peak memory of baseline, DIFF V1 and DIFF V2 at matched size",
            "Times forward and forward+backward of baseline, DIFF V1 and DIFF V2 "
            "(and HF DiffLlama / Llama when transformers is installed), interleaved in one run.",
        ),
        (
            "backends",
            backends,
            "attention backends, what auto picks per call here, and (--time) why",
            "Lists the attention backends and what 'auto' resolves each call to on "
            "this machine; --time times the candidates per case, interleaved.",
        ),
    ):
        sub = verbs.add_parser(verb, help=help_text, description=description)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)

    sizes = verbs.add_parser("presets", help="list presets with parameter counts per type")
    sizes.add_argument("name", nargs="?", help="one preset (default: all)")
    sizes.set_defaults(handler=_presets_command)

    for verb, help_text in VERBS:
        try:
            module = importlib.import_module(f"diffattn.commands.{verb.replace('-', '_')}")
            sub = verbs.add_parser(
                verb,
                help=help_text,
                description=getattr(module, "DESCRIPTION", None),
                **getattr(module, "PARSER_OPTIONS", {}),
            )
            module.add_arguments(sub)
        except ModuleNotFoundError as error:  # its arguments need an extra missing here
            message = missing_extra(error, VERB_EXTRAS.get(verb, ()))
            if message is None:
                raise
            add_unavailable(verbs, verb, help_text, error, message, summary=help_text)
            continue
        sub.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_unknown_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # as parse_args says it
    try:
        return int(args.handler(args) or 0)
    except ValueError as error:  # invalid settings: one clear message, exit code 2
        print(f"diffattn {args.verb}: error: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:  # an optional package this run needs is missing
        message = missing_extra(error, VERB_EXTRAS.get(args.verb, ()))
        if message is None:
            raise
        print(f"diffattn {args.verb}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
