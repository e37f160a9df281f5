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
    ("data", "prepare token shards apart from training (train's cache), inspect them"),
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
    """Parameter counts per attention type, and the SwiGLU width of each type matched by
    narrowing it (``AttentionType.matches_by_ffn``; DIFF V2) with the difference from the
    baseline that rounding it to a multiple of 64 leaves (presets.match_v2_params). The first
    table has the types ``diffattn bench`` times by default (the papers' three), then every
    other registered type; with a preset named, each type's heads (``AttentionType.describe``)."""
    from diffattn import presets
    from diffattn.attention.types import attention_type, attention_type_names
    from diffattn.bench.options import default_types
    from diffattn.model import count_parameters

    names = [args.name] if args.name else presets.names()
    first = default_types()
    matched = [t for t in first if _matched_by_ffn(presets, t)]
    columns = (*first, *(f"{t} matched" for t in matched))
    print(
        f"{'preset':>7} "
        + " ".join(f"{c:>15}" for c in columns)
        + "".join(f" {t} ffn  {t} vs base" for t in matched)
    )
    for name in names:
        counts = [count_parameters(presets.get(name, attention=t)) for t in first]
        cells = [f"{c:>15,}" for c in counts]
        tail = ""
        for t in matched:
            config = presets.get(name, t, match_params=True)
            count = count_parameters(config)
            cells.append(f"{count:>15,}")
            tail += f" {config.ffn_dim:>6} {(count - counts[0]) / counts[0]:>+10.3%}"
        print(f"{name:>7} " + " ".join(cells) + tail)
    others = [t for t in attention_type_names() if t not in first]
    if others:
        print("other attention types (matched: the SwiGLU narrowed to the baseline's count):")
        for name in names:
            base = count_parameters(presets.get(name))
            for t in others:
                print(f"{name:>7} {t:<12} {_other_row(presets, name, t, base)}")
    if args.name:
        for t in (*first, *others):
            try:
                config = presets.get(args.name, attention=t)
            except ValueError as error:
                print(f"{t}: does not fit {args.name}: {error}")
                continue
            print(f"{t}: {attention_type(t).describe(config)}")
    return 0


def _matched_by_ffn(presets, type_name: str) -> bool:
    """Whether ``type_name`` narrows the SwiGLU to match the baseline (at the tiny preset)."""
    config = presets.get("tiny", attention=type_name)
    return config.type_of_layer(0).matches_by_ffn(config)


def _other_row(presets, preset: str, type_name: str, base: int) -> str:
    """The parameter count of ``type_name`` at ``preset`` (and matched, where it narrows the
    SwiGLU), or why its heads do not fit the preset."""
    from diffattn.model import count_parameters

    try:
        config = presets.get(preset, attention=type_name)
    except ValueError as error:
        return f"does not fit: {error}"
    text = f"{count_parameters(config):>15,}"
    if config.type_of_layer(0).matches_by_ffn(config):
        narrowed = presets.get(preset, type_name, match_params=True)
        count = count_parameters(narrowed)
        text += f"  matched {count:>15,} ffn {narrowed.ffn_dim:>6} {(count - base) / base:>+10.3%}"
    return text


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
