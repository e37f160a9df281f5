"""``diffattn long-context``: the data and model steps of context extension (DIFF V1 §3.3).

``upsample`` writes a length-upsampled corpus (:mod:`diffattn.data.upsample`);
``widen`` writes a copy of a model with a larger context limit (and optionally another RoPE θ)
and unchanged weights, e.g. the model before extension, to be measured at the new length.
The continued training itself is ``diffattn train`` with the recipe
``recipes/long_context.yaml`` (``init_from``, θ = 640,000, lr 8e-5); see
``docs/long_context.md``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from diffattn.settings import Settings, setting

DESCRIPTION = (
    "Context extension as in DIFF V1 §3.3. `upsample`: per-source length upsampling of a "
    "corpus (Fu et al. 2024) into OUT/train.jsonl with its length statistics; `widen`: a copy "
    "of a model directory with a larger max_seq_len (and --rope-theta), weights unchanged. "
    "Train with `diffattn train src/diffattn/recipes/long_context.yaml --set init_from=CKPT`."
)


@dataclass(frozen=True, kw_only=True)
class UpsampleSettings(Settings):
    """The options of ``diffattn long-context upsample``, each declared once."""

    data: tuple[str, ...] = setting(("stdlib",), help="data specs, one per source")
    tokenizer: str = setting(
        required=True,
        help="the model's tokenizer: a model or checkpoint directory, hf:DIR or tiktoken:NAME",
    )
    target_len: int = setting(required=True, help="training length (tokens)")
    threshold: int | None = setting(
        None, help="documents of at least this many tokens are long (default: target-len / 4)"
    )
    long_share: float = setting(
        0.5, help="share of each source's tokens from long documents (default {default})"
    )
    budget: int | None = setting(None, help="tokens to write (default: the corpus size)")
    seed: int = setting(0)
    max_bytes: int | None = setting(None, help="cap on the text read from each source")
    out: str = setting("runs/long-context/data", help="output directory")


@dataclass(frozen=True, kw_only=True)
class WidenSettings(Settings):
    """The options of ``diffattn long-context widen``, each declared once."""

    model: str = setting(positional=True, help="a diffattn model directory (e.g. a checkpoint)")
    max_seq_len: int = setting(required=True)
    rope_theta: float | None = setting(None, help="default: unchanged")
    out: str = setting(required=True, help="the new model directory")
    overwrite: bool = setting(False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``long-context`` verb's actions to ``parser``."""
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = actions.add_parser(
        "upsample", help="length-upsample a corpus (per source, Fu et al. 2024)"
    )
    UpsampleSettings.add_arguments(up)
    widen = actions.add_parser(
        "widen", help="copy a model with a larger max_seq_len (and RoPE θ), same weights"
    )
    WidenSettings.add_arguments(widen)


def _tokenizer(spec: str):
    from pathlib import Path

    from diffattn.data.tokenizers import load_tokenizer

    if Path(spec).is_dir():
        spec = f"hf:{spec}"
    return load_tokenizer(spec)


def _upsample(settings: UpsampleSettings) -> int:
    from diffattn.data.upsample import upsample_corpus

    result = upsample_corpus(
        settings.data,
        _tokenizer(settings.tokenizer),
        settings.out,
        target_len=settings.target_len,
        threshold=settings.threshold,
        long_share=settings.long_share,
        budget=settings.budget,
        seed=settings.seed,
        max_bytes=settings.max_bytes,
    )
    print(f"{'':24} {'before':>10} {'after':>10}")
    rows = (
        ("documents", "documents", "{:>10,}"),
        ("tokens", "tokens", "{:>10,}"),
        (f"long share (>= {result.settings['threshold']})", "long_share", "{:>10.3f}"),
        ("windows in one document", "window_single_document", "{:>10.3f}"),
        ("documents per window", "documents_per_window", "{:>10.2f}"),
    )
    for label, key, form in rows:
        before, after = getattr(result.before, key), getattr(result.after, key)
        print(f"{label:24} {form.format(before)} {form.format(after)}")
    print(
        f"copies per long document: mean {result.repeats['long_mean']:.2f}, max "
        f"{result.repeats['long_max']:.0f}; per short document: mean "
        f"{result.repeats['short_mean']:.2f}, max {result.repeats['short_max']:.0f}"
    )
    print(f"wrote {result.path} and {result.stats_path}")
    return 0


def _widen(settings: WidenSettings) -> int:
    import dataclasses
    import json
    import shutil
    from pathlib import Path

    from diffattn.checkpoint import (
        CONFIG_NAME,
        WEIGHTS_INDEX_NAME,
        config_to_json_dict,
        read_config,
        weight_files,
    )
    from diffattn.fileio import atomic_directory, check_output_directory, copy_tokenizer_files

    source, out = Path(settings.model), Path(settings.out)
    config = read_config(source)
    if settings.max_seq_len < config.max_seq_len:
        raise ValueError(
            f"--max-seq-len {settings.max_seq_len} is below the model's {config.max_seq_len}"
        )
    changes: dict = {"max_seq_len": settings.max_seq_len}
    if settings.rope_theta is not None:
        changes["rope_theta"] = settings.rope_theta
    widened = dataclasses.replace(config, **changes)  # validated on construction
    files = weight_files(source)
    check_output_directory(out, settings.overwrite, option="--out", hint="pass --overwrite")
    with atomic_directory(out, overwrite=True) as tmp:
        for path in [*files, source / WEIGHTS_INDEX_NAME]:
            if path.is_file():
                shutil.copyfile(path, tmp / path.name)
        copy_tokenizer_files(source, tmp)
        text = json.dumps(config_to_json_dict(widened), indent=2, sort_keys=True) + "\n"
        (tmp / CONFIG_NAME).write_text(text, encoding="utf-8")
    print(
        f"wrote {out}: max_seq_len {config.max_seq_len} -> {widened.max_seq_len}, rope_theta "
        f"{config.rope_theta:g} -> {widened.rope_theta:g}, weights unchanged"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "upsample":
        return _upsample(UpsampleSettings.from_args(args))
    return _widen(WidenSettings.from_args(args))
