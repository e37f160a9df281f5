"""``diffattn data``: prepare token shards apart from training, and inspect them.

``prepare`` runs what ``diffattn train`` runs before its first step
(:func:`diffattn.data.prepare_data`, with the same cache key), from a recipe's ``data:``
section (``--set data.x=...`` as train takes it) or from flags, so a later ``diffattn train``
of the same recipe finds the shards; ``--engine ray`` tokenises on Ray Data
(:mod:`diffattn.data.ray_engine`: the same shards and key). ``inspect`` shows what a
preparation or a shard set holds (:mod:`diffattn.data.inspection`). See ``docs/data.md``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from diffattn.settings import Settings, progress_switch, setting
from diffattn.train.cli import recipe_overrides

DESCRIPTION = (
    "Token shards apart from training. `prepare`: tokenise a recipe's data: section (or the "
    "sources given by flags) into the cache that `diffattn train` of the same recipe then "
    "reads, under the same key; `inspect`: totals, split, fingerprint, tokenizer, shards and "
    "sample documents of a prepared directory, a shard set or a recipe's prepared data."
)


@dataclass(frozen=True, kw_only=True)
class PrepareSettings(Settings):
    """The options of ``diffattn data prepare``, each declared once. A flag left out keeps
    the recipe's entry (without a recipe: DataConfig's default)."""

    recipe: str | None = setting(
        None,
        positional=True,
        nargs="?",
        metavar="RECIPE",
        help="YAML recipe whose data: section to prepare (a path or a shipped name); "
        "without it, the flags describe the data",
    )
    overrides: Sequence[str] = recipe_overrides(
        "override a recipe entry as diffattn train does (e.g. --set data.tokenizer=bpe:4096); "
        "repeatable"
    )
    sources: tuple[str, ...] | None = setting(
        None, flag="--source", metavar="SPEC", help="source specs (replace the recipe's)"
    )
    weights: tuple[float, ...] | None = setting(
        None,
        flag="--weight",
        metavar="W",
        help="mixture weights, one per --source: each source's share of the training tokens",
    )
    tokenizer: str | None = setting(None, help="bpe:VOCAB, tiktoken:NAME or hf:PATH")
    text_field: str | None = setting(None, help="JSON lines / Parquet / hf: text field")
    document_split: Literal["file", "paragraph", "line"] | None = setting(
        None, help="plain text files: one document per file, paragraph or line"
    )
    valid_fraction: float | None = setting(None, help="share of documents held out")
    seed: int | None = setting(None, help="seed of the validation split and of a mixture")
    max_bytes: int | None = setting(None, help="cap on the text read from all sources")
    shard_tokens: int | None = setting(None, help="tokens per shard file")
    cache_dir: str | None = setting(None, help="cache root (default: $DIFFATTN_CACHE/data)")
    strict: bool = setting(False, help="refuse binary documents and invalid UTF-8")
    engine: Literal["local", "ray"] = setting(
        "local",
        help="who tokenises: this process (local, default) or Ray Data (ray: the same shards "
        "and cache key, resumable; pip install 'diffattn[ray]')",
    )
    workers: int | None = setting(
        None,
        min=1,
        help="--engine ray: tasks run at once (default: the CPU count, or the cluster's CPUs)",
    )
    address: str | None = setting(
        None,
        metavar="ADDR",
        help="--engine ray: a running Ray cluster (HOST:PORT, ray://HOST:PORT or auto) "
        "instead of an embedded local Ray",
    )
    task_bytes: int | None = setting(
        None,
        min=1,
        help="--engine ray: input bytes per task (default 4 MiB; a larger file is one task, "
        "a Parquet file one per row group, a JSON lines file one per range of this size)",
    )
    progress: bool = progress_switch("no progress bar or notices")


@dataclass(frozen=True, kw_only=True)
class InspectSettings(Settings):
    """The options of ``diffattn data inspect``, each declared once."""

    path: str = setting(
        positional=True,
        help="a prepared directory (CACHE/shards/KEY), a shard set (with manifest.json) or a "
        "recipe whose prepared data to find",
    )
    overrides: Sequence[str] = recipe_overrides("override a recipe entry (with a recipe)")
    samples: int = setting(3, min=0, help="documents decoded per split (default {default})")
    verify: bool = setting(False, help="re-hash every shard against its sidecar")
    json: bool = setting(False, help="print one JSON object instead of text")


FLAG_FIELDS = (
    "sources",
    "weights",
    "tokenizer",
    "text_field",
    "document_split",
    "valid_fraction",
    "seed",
    "max_bytes",
    "shard_tokens",
    "cache_dir",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``data`` verb's actions to ``parser``."""
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prepare = actions.add_parser(
        "prepare",
        help="tokenise into the cache diffattn train reads (same key)",
        description="Tokenise a recipe's data: section, or the sources the flags give, into "
        "cached train/valid shard sets: the entry diffattn train of that recipe then opens.",
    )
    PrepareSettings.add_arguments(prepare)
    inspect = actions.add_parser(
        "inspect",
        help="totals, split, fingerprint, tokenizer, shards and sample documents",
        description="Show what a prepared directory, a shard set or a recipe's prepared data "
        "holds; a truncated shard or garbled manifest is one error line naming the file.",
    )
    InspectSettings.add_arguments(inspect)


def _is_recipe(path: str) -> bool:
    return path.endswith((".yaml", ".yml")) or not Path(path).exists()


def recipe_data_config(recipe: str, overrides: Sequence[str]) -> Any:
    """The :class:`~diffattn.data.DataConfig` that ``diffattn train RECIPE --set ...`` prepares
    (the recipe read and validated as train reads it)."""
    from diffattn.recipes import resolve_recipe
    from diffattn.train import load_config

    try:
        path = resolve_recipe(recipe)
    except FileNotFoundError as missing:
        raise ValueError(f"config: {missing}") from None
    return load_config(path, list(overrides), notes=[]).data_config()


def data_config(settings: PrepareSettings) -> Any:
    """The configuration to prepare: the recipe's (or DataConfig's defaults), then each flag
    that is given."""
    from diffattn.data import DataConfig

    if settings.recipe is None and settings.overrides:
        raise ValueError("--set overrides a recipe entry; give the recipe")
    changes: dict[str, Any] = {
        name: getattr(settings, name) for name in FLAG_FIELDS if getattr(settings, name) is not None
    }
    if settings.strict:
        changes["strict"] = True
    if "weights" in changes and "sources" not in changes and settings.recipe is None:
        raise ValueError("--weight needs --source (one weight per source)")
    if settings.recipe is None:
        return DataConfig.from_dict(changes)
    # --weight alone weighs the recipe's sources; --source alone drops the recipe's weights
    return recipe_data_config(settings.recipe, settings.overrides).replace(**changes)


def _engine(settings: PrepareSettings, config: Any) -> Any:
    """The :class:`~diffattn.data.ray_engine.RayEngine` ``--engine ray`` asks for, connected
    (``None`` for the local engine, which takes no --workers, --address or --task-bytes)."""
    if settings.engine == "local":
        for name in ("workers", "address", "task_bytes"):
            if getattr(settings, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} applies to --engine ray")
        return None
    from diffattn.data.prepare import check_engine_config
    from diffattn.data.ray_engine import DEFAULT_TASK_BYTES, RayEngine

    check_engine_config(config)
    task_bytes = settings.task_bytes or DEFAULT_TASK_BYTES
    return RayEngine(settings.workers, settings.address, task_bytes).connect()


def _prepare(settings: PrepareSettings) -> int:
    from diffattn.data import prepare_data
    from diffattn.data.inspection import describe, inspect_path

    settings.check()
    config = data_config(settings)
    engine = _engine(settings, config)
    try:
        data = prepare_data(config, progress=settings.progress, engine=engine)
    finally:
        if engine is not None:
            engine.close()
    summary = inspect_path(data.directory, samples=0)
    how = "found in the cache" if data.cached else f"prepared in {data.stats.seconds:.1f} s"
    print(f"diffattn data: {how}")
    print("\n".join(describe(summary)))
    return 0


def _inspect(settings: InspectSettings) -> int:
    from diffattn.data.inspection import describe, describe_shards, find_prepared, inspect_path

    path = settings.path
    if not (Path(path).is_dir()) and _is_recipe(path):
        path = str(find_prepared(recipe_data_config(path, settings.overrides)))
    elif settings.overrides:
        raise ValueError("--set overrides a recipe entry; PATH is no recipe")
    summary = inspect_path(path, samples=settings.samples, verify=settings.verify)
    if settings.json:
        print(json.dumps(summary, indent=2))
    else:
        print("\n".join([*describe(summary), *describe_shards(summary)]))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``diffattn data ACTION``; a bad input is one ``ValueError`` (exit code 2)."""
    if args.action == "prepare":
        return _prepare(PrepareSettings.from_args(args))
    settings = InspectSettings.from_args(args)
    settings.check()
    return _inspect(settings)
