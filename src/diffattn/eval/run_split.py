"""The held-out split an evaluation reads: the trained run's own, never a guess.

A diffattn checkpoint written by the trainer carries its recipe (``train_config.yaml``), whose
``data`` section decides which documents the run held out: ``sources``, ``valid_fraction`` and
``seed`` (document-level split, ``diffattn.data.is_validation_document``) over the documents
its ``text_field``, ``document_split`` and ``max_bytes`` cut, and whose ``seq_len`` is the
window the run trained on. For such a model every ``diffattn eval`` experiment that reads
documents takes these from the run unless a flag gives them, and records where each value came
from. A flag that changes the held-out documents (other sources, another fraction or seed) would
score documents the run trained on as held out, so it is refused with one line naming both
values, unless ``--split all`` says every document is wanted. ``--seq-len`` and
``--max-tokens`` only change the windows and are taken as given. Models without a recipe (Hugging
Face directories, saved models, GGUF) keep the evaluation's own defaults, and the record says so.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

TRAIN_CONFIG_NAME = "train_config.yaml"
SPLIT_KEYS = ("data", "valid_fraction", "data_seed")
"""The settings that decide which documents are held out."""


@dataclass(frozen=True)
class RunSplit:
    """What a run's recipe says about its data: the split and its training window."""

    recipe: Path
    data: tuple[str, ...]
    valid_fraction: float
    data_seed: int
    seq_len: int
    reading: tuple[tuple[str, Any], ...] = ()
    """How the trainer cut the sources into documents: ``text_field``, ``split`` (file,
    paragraph or line) and ``max_bytes`` of :func:`diffattn.data.iter_documents`."""
    document_masking: bool = False
    """Whether the run attended only within the documents of a window (split after every
    EOS, ``TrainConfig.document_masking``); its windows are then evaluated so too."""

    def value(self, key: str) -> Any:
        return list(self.data) if key == "data" else getattr(self, key)


def recipe_of(spec: str) -> Path | None:
    """The training recipe stored with model ``spec`` (a checkpoint directory, or a training
    run or ``RUN@STEP`` standing for one), or ``None``."""
    from diffattn.loading import training_run_checkpoint

    path = training_run_checkpoint(spec) or Path(str(spec)).expanduser()
    recipe = path / TRAIN_CONFIG_NAME
    return recipe if recipe.is_file() else None


def run_split(recipe: Path) -> RunSplit:
    """The split a recipe trained with, its unset keys at ``DataConfig``'s and ``TrainConfig``'s
    defaults (what the trainer used)."""
    import yaml

    from diffattn.data import DataConfig
    from diffattn.train.config import TrainConfig

    try:
        loaded = yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"{recipe}: cannot read the run's recipe: {error}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{recipe}: the run's recipe is not a mapping")
    data_defaults = {f.name: f.default for f in fields(DataConfig)}
    data = {**data_defaults, **(loaded.get("data") or {})}
    train_defaults = {f.name: f.default for f in fields(TrainConfig)}
    sources = data["sources"]
    return RunSplit(
        recipe=recipe,
        data=tuple([sources] if isinstance(sources, str) else sources),
        valid_fraction=float(data["valid_fraction"]),
        data_seed=int(data["seed"]),
        seq_len=int(loaded.get("seq_len", train_defaults["seq_len"])),
        document_masking=bool(loaded.get("document_masking", train_defaults["document_masking"])),
        reading=(
            ("text_field", data["text_field"]),
            ("split", data["document_split"]),
            ("max_bytes", data["max_bytes"]),
        ),
    )


def resolve(args: Any, defaults: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Fill ``args``' data settings (``None``: not given) from the models' runs or ``defaults``;
    returns, per setting, its value and where it came from.

    Raises:
        ValueError: the models come from runs with different splits and no flag decides, or a
            flag changes a run's held-out documents without ``--split all``.
    """
    specs = [args.model, *getattr(args, "compare", [])]
    splits = {}
    for spec in specs:
        recipe = recipe_of(spec)
        if recipe is not None:
            splits[spec] = run_split(recipe)
    everything = getattr(args, "split", "valid") == "all"
    provenance: dict[str, dict[str, Any]] = {}
    readings = {split.reading for split in splits.values()}
    if len(readings) > 1 and not everything:
        raise ValueError(
            "the models' runs cut their sources into documents differently (data.text_field, "
            "data.document_split or data.max_bytes): no one held-out split holds for all of "
            "them; pass --split all"
        )
    # documents are cut as the run cut them (whole files for models without a recipe)
    args.document_reading = dict(next(iter(readings))) if len(readings) == 1 else {}
    if args.document_reading:
        provenance["documents"] = {
            "value": ", ".join(f"{k}={v}" for k, v in args.document_reading.items()),
            "from": f"the run's recipe ({next(iter(splits.values())).recipe})",
        }
    provenance["document_masking"] = _masking(specs, splits)
    for key in (*SPLIT_KEYS, "seq_len"):
        given = getattr(args, key)
        run_values = {spec: split.value(key) for spec, split in splits.items()}
        flag = "--" + key.replace("_", "-")
        if given is not None:
            if key in SPLIT_KEYS and not everything:
                for spec, value in run_values.items():
                    if _differs(key, given, value):
                        raise ValueError(
                            f"{flag} {_show(given)} contradicts the run of {spec}, which held out "
                            f"documents by {key} {_show(value)} ({splits[spec].recipe}): its "
                            "held-out split would include documents it trained on; leave the "
                            "flag out, or pass --split all to evaluate every document"
                        )
            provenance[key] = {"value": given, "from": flag}
            continue
        distinct = {_key(v) for v in run_values.values()}
        if len(distinct) > 1 and (key in SPLIT_KEYS and not everything):
            listed = "; ".join(f"{s}: {_show(v)}" for s, v in run_values.items())
            raise ValueError(
                f"the models' runs held out documents by different {key} ({listed}); no one "
                f"split is held out for all of them: give {flag}, or --split all"
            )
        if run_values and len(distinct) == 1:
            spec, value = next(iter(run_values.items()))
            setattr(args, key, value)
            provenance[key] = {"value": value, "from": f"the run's recipe ({splits[spec].recipe})"}
        else:
            setattr(args, key, defaults[key])
            why = "the evaluation's default (no training recipe with the model)"
            if run_values:
                why = "the evaluation's default (the runs differ; --split all)"
            provenance[key] = {"value": defaults[key], "from": why}
    return provenance


def _masking(specs: list[str], splits: dict[str, RunSplit]) -> dict[str, Any]:
    """Where each model's windows are masked by document: as its run trained
    (``document_masking``: within each document, split after every EOS), else not at all."""
    values = {
        spec: "within documents"
        if spec in splits and splits[spec].document_masking
        else "across documents"
        for spec in specs
    }
    sources = {
        f"the run's recipe ({splits[spec].recipe})" if spec in splits else "no training recipe"
        for spec in specs
    }
    if len(set(values.values())) == 1:
        return {"value": next(iter(values.values())), "from": "; ".join(sorted(sources))}
    listed = "; ".join(f"{spec}: {value}" for spec, value in values.items())
    return {"value": listed, "from": "each model's run recipe (document_masking)"}


def _key(value: Any) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value


def _differs(key: str, given: Any, value: Any) -> bool:
    if key == "data":
        return list(given) != list(value)
    if key == "valid_fraction":
        return abs(float(given) - float(value)) > 1e-12
    return given != value


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def report_lines(provenance: dict[str, dict[str, Any]]) -> str:
    """The markdown lines that say where each data setting came from."""
    if not provenance:
        return ""
    rows = "".join(
        f"| {key} | {_show(entry['value'])} | {entry['from']} |\n"
        for key, entry in provenance.items()
    )
    return "| data setting | value | from |\n|---|---|---|\n" + rows + "\n"
