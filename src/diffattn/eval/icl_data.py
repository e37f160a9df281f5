"""Classification data for ``diffattn eval icl``: prompt formats, loaders and a synthetic task.

Datasets (DIFF V1 §3.5, Fig 6; formats after Bertsch et al. 2024):

=============  ======================  ===========================================  =======
name           format                  hub source (``--data hub``)                  classes
=============  ======================  ===========================================  =======
``trec``       ``Question: …\\nType:``  ``CogComp/trec``, field ``coarse_label``      6
``trec-fine``  ``Question: …\\nType:``  ``CogComp/trec``, field ``fine_label``        50
``banking77``  ``query: …\\nintent:``   ``PolyAI/banking77``, field ``label``         77
``clinic150``  ``utterance: …\\nintent:`` ``clinc_oos`` (config ``plus``), ``intent``  150 (+oos)
``synthetic``  ``text: …\\nlabel:``     generated (:func:`synthetic_task`)           ``--classes``
=============  ======================  ===========================================  =======

Sources (``--data``), each giving a ``train`` split (the demonstration pool) and a ``test``
split (the evaluated items; ``validation`` is used when there is no ``test``):

* a directory holding ``train.jsonl`` and ``test.jsonl`` (``.jsonl.gz`` too), one object per
  line with a text field (``text``, else the first of ``question``, ``query``, ``utterance``,
  ``sentence``) and a label field (``label``, else the dataset's hub field); a label is a
  string, or an integer with the names in ``labels.json`` (a list) beside the files;
* a ``datasets`` ``save_to_disk`` directory of a ``DatasetDict`` (``dataset_dict.json`` and one
  directory per split, arrow files), read with ``datasets`` when installed, else with
  ``pyarrow``; integer labels take their names from the ``ClassLabel`` feature;
* ``hub``: ``datasets.load_dataset`` on the hub source above (needs ``datasets`` and the
  network).

Label names become words: ``_`` and ``-`` to spaces (``card_arrival`` → ``card arrival``), and
TREC's coarse codes to ``abbreviation``, ``entity``, ``description``, ``human``, ``location``,
``number`` (fine labels keep their code: ``HUM:ind``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffattn.eval.common import read_jsonl

SPLITS = ("train", "test")
TEXT_FIELDS = ("text", "question", "query", "utterance", "sentence")
TREC_COARSE = {
    "ABBR": "abbreviation",
    "ENTY": "entity",
    "DESC": "description",
    "HUM": "human",
    "LOC": "location",
    "NUM": "number",
}


@dataclass(frozen=True)
class ICLFormat:
    """How one demonstration is written: ``input_prefix + text + label_prefix + " " + label``;
    demonstrations are joined by ``separator``."""

    input_prefix: str
    label_prefix: str
    separator: str = "\n\n"


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    format: ICLFormat
    hub: tuple[str, str | None]  # (path, config)
    label_field: str


DATASETS = {
    "trec": DatasetSpec(
        "trec", ICLFormat("Question: ", "\nType:"), ("CogComp/trec", None), "coarse_label"
    ),
    "trec-fine": DatasetSpec(
        "trec-fine", ICLFormat("Question: ", "\nType:"), ("CogComp/trec", None), "fine_label"
    ),
    "banking77": DatasetSpec(
        "banking77", ICLFormat("query: ", "\nintent:"), ("PolyAI/banking77", None), "label"
    ),
    "clinic150": DatasetSpec(
        "clinic150", ICLFormat("utterance: ", "\nintent:"), ("clinc_oos", "plus"), "intent"
    ),
    "synthetic": DatasetSpec("synthetic", ICLFormat("text: ", "\nlabel:"), ("", None), "label"),
}


@dataclass(frozen=True)
class Example:
    text: str
    label: str


@dataclass
class ICLData:
    name: str
    format: ICLFormat
    train: list[Example]
    test: list[Example]

    @property
    def labels(self) -> list[str]:
        """Every label of either split, sorted."""
        return sorted({e.label for e in self.train} | {e.label for e in self.test})


def label_word(name: str, dataset: str) -> str:
    """The label as the prompt writes it (see the module docstring)."""
    name = str(name).strip()
    if dataset == "trec" and name in TREC_COARSE:
        return TREC_COARSE[name]
    if dataset == "trec-fine":
        return name
    return name.replace("_", " ").replace("-", " ")


# --- synthetic --------------------------------------------------------------------------------

FILLER = (
    "the", "a", "one", "some", "my", "our", "this", "that", "green", "old", "small", "quiet",
    "bright", "heavy", "round", "cold", "early", "late", "near", "under", "over", "with",
    "about", "from", "into", "table", "window", "river", "garden", "letter", "engine",
    "kettle", "ladder", "basket", "pencil", "mirror", "carpet", "bottle", "candle", "wagon",
    "is", "was", "has", "sees", "finds", "keeps", "moves", "holds", "needs", "brings",
)  # fmt: skip
"""Words every synthetic class shares: they carry no information about the class."""

ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "kl", "st")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")


def _pseudo_words(rng: random.Random, n: int, syllables: tuple[int, int]) -> list[str]:
    words: list[str] = []
    seen = set(FILLER)
    while len(words) < n:
        count = rng.randint(*syllables)
        word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(count))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def synthetic_task(
    classes: int = 20,
    keywords: int = 3,
    train: int = 2000,
    test: int = 500,
    words: tuple[int, int] = (4, 8),
    seed: int = 0,
) -> ICLData:
    """A many-class task that only in-context learning can solve.

    Each class gets a made-up label word (2–3 syllables) and ``keywords`` made-up cue words
    (1–2 syllables), all drawn from ``seed``; an example is ``words`` filler words (shared by
    every class) with one cue word of its class at a random place. The cue→label mapping is
    new for every seed, so a model knows nothing about it before reading the demonstrations;
    a test item is solvable only when a demonstration shows one of its class's cues with the
    label, so accuracy rises with the number of shots (``classes × keywords`` cues in all).
    """
    if classes < 2 or keywords < 1 or train < 1 or test < 1:
        raise ValueError("the synthetic task needs at least 2 classes, 1 keyword, 1 example")
    if words[0] < 1 or words[1] < words[0]:
        raise ValueError(f"synthetic words must be 1 ≤ low ≤ high, got {words}")
    rng = random.Random(f"synthetic-{seed}")
    labels = _pseudo_words(rng, classes, (2, 3))
    cues = _pseudo_words(rng, classes * keywords + classes, (1, 2))
    cues = [w for w in cues if w not in labels][: classes * keywords]
    cue_of = {label: cues[i * keywords : (i + 1) * keywords] for i, label in enumerate(labels)}

    def example() -> Example:
        label = rng.choice(labels)
        text = [rng.choice(FILLER) for _ in range(rng.randint(*words))]
        text.insert(rng.randrange(len(text) + 1), rng.choice(cue_of[label]))
        return Example(" ".join(text), label)

    return ICLData(
        "synthetic",
        DATASETS["synthetic"].format,
        [example() for _ in range(train)],
        [example() for _ in range(test)],
    )


# --- files ------------------------------------------------------------------------------------


def _split_file(directory: Path, split: str) -> Path | None:
    for name in (f"{split}.jsonl", f"{split}.jsonl.gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def _examples(
    rows: list[dict[str, Any]], spec: DatasetSpec, names: list[str] | None, where: str
) -> list[Example]:
    out = []
    for i, row in enumerate(rows):
        text_field = next((f for f in TEXT_FIELDS if f in row), None)
        label_field = next((f for f in ("label", spec.label_field) if f in row), None)
        if text_field is None or label_field is None:
            raise ValueError(
                f"{where}: row {i} has no text field ({', '.join(TEXT_FIELDS)}) or no label "
                f"field (label or {spec.label_field}); it has {sorted(row)}"
            )
        label = row[label_field]
        if isinstance(label, int) and not isinstance(label, bool):
            if names is None or not 0 <= label < len(names):
                raise ValueError(
                    f"{where}: row {i} has integer label {label} and no name for it "
                    "(give labels.json, or string labels)"
                )
            label = names[label]
        out.append(Example(str(row[text_field]).strip(), label_word(label, spec.name)))
    return out


def _jsonl_splits(directory: Path, spec: DatasetSpec) -> dict[str, list[Example]]:
    names = None
    if (directory / "labels.json").is_file():
        names = json.loads((directory / "labels.json").read_text(encoding="utf-8"))
    splits = {}
    for split in SPLITS:
        path = _split_file(directory, split) or (
            _split_file(directory, "validation") if split == "test" else None
        )
        if path is None:
            raise ValueError(f"--data {directory}: no {split}.jsonl")
        splits[split] = _examples(read_jsonl(path), spec, names, str(path))
    return splits


def _class_names(features: dict[str, Any], field: str) -> list[str] | None:
    feature = features.get(field) or {}
    return list(feature["names"]) if isinstance(feature, dict) and "names" in feature else None


def _arrow_split(directory: Path, spec: DatasetSpec) -> list[Example]:
    """One ``save_to_disk`` split: its arrow stream files and ``dataset_info.json``."""
    import pyarrow as pa

    info_path = directory / "dataset_info.json"
    features = (
        json.loads(info_path.read_text("utf-8")).get("features", {}) if info_path.is_file() else {}
    )
    files = sorted(directory.glob("*.arrow"))
    if not files:
        raise ValueError(f"--data {directory}: no .arrow files in this split directory")
    rows: list[dict[str, Any]] = []
    for file in files:
        with pa.memory_map(str(file)) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(source).read_all()
        rows.extend(table.to_pylist())
    field = next((f for f in ("label", spec.label_field) if rows and f in rows[0]), "label")
    return _examples(rows, spec, _class_names(features, field), str(directory))


def _disk_splits(directory: Path, spec: DatasetSpec) -> dict[str, list[Example]]:
    listed = json.loads((directory / "dataset_dict.json").read_text("utf-8")).get("splits", [])
    splits = {}
    for split in SPLITS:
        name = split if split in listed else ("validation" if split == "test" else None)
        if name not in listed:
            raise ValueError(f"--data {directory}: no {split} split (it has {listed})")
        splits[split] = _arrow_split(directory / name, spec)
    return splits


def _hub_splits(spec: DatasetSpec) -> dict[str, list[Example]]:
    try:
        import datasets
    except ImportError:
        raise ValueError("--data hub needs the datasets package: pip install datasets") from None
    path, config = spec.hub
    loaded = datasets.load_dataset(path, config)
    splits = {}
    for split in SPLITS:
        name = split if split in loaded else "validation"
        part = loaded[name]
        field = spec.label_field
        names = getattr(part.features.get(field), "names", None)
        splits[split] = _examples(list(part), spec, names, f"{path}[{name}]")
    return splits


def load_dataset(name: str, data: str | None = None, classes: int = 20, seed: int = 0) -> ICLData:
    """The dataset ``name`` (:data:`DATASETS`) from ``data`` (see the module docstring);
    ``synthetic`` is generated from ``classes`` and ``seed`` and takes no ``data``."""
    if name not in DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {name!r}")
    spec = DATASETS[name]
    if name == "synthetic":
        if data is not None:
            raise ValueError("--dataset synthetic is generated; it takes no --data")
        return synthetic_task(classes=classes, seed=seed)
    if data is None:
        raise ValueError(f"--dataset {name} needs --data DIR (jsonl or save_to_disk) or hub")
    if data == "hub":
        splits = _hub_splits(spec)
    else:
        directory = Path(data)
        if (directory / "dataset_dict.json").is_file():
            splits = _disk_splits(directory, spec)
        elif directory.is_dir():
            splits = _jsonl_splits(directory, spec)
        else:
            raise ValueError(f"--data {data!r}: not a directory and not hub")
    for split, examples in splits.items():
        if not examples:
            raise ValueError(f"--data {data}: the {split} split is empty")
    return ICLData(name, spec.format, splits["train"], splits["test"])
