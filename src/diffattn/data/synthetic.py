"""Synthetic retrieval documents: multi-key associative recall and needles among distractors.

Two tasks make the papers' retrieval claims measurable on small models, as a data source
(``"synthetic:TASK?key=value&..."``) that mixes with any other:

* ``synthetic:recall`` — multi-query associative recall (MQAR, Arora et al. 2023 "Zoology",
  the origin of DIFF V1 Table 6's AR-Hit slice). A document lists ``pairs`` key–value pairs,
  then asks for ``queries`` of them in a random order::

      Pairs: river 41, stone 07, apple 93. Recall: apple 93, river 41.

  Keys are words from :data:`RECALL_KEYS`, values two-digit numbers, both drawn anew for every
  document, so a value after its key in the recall part can only come from the context.
* ``synthetic:needle`` — the needle task of DIFF V1 §3.4 (Table 2) with distractors: a haystack
  of plain sentences (:data:`HAYSTACK_SENTENCES`) holding ``1..needles`` needles
  ``" The magic number of CITY is NUMBER."`` (distinct cities and 7-digit numbers), then the
  question about the first ``R`` of them (``R ≤ queries``) and its answer, in exactly the
  format ``diffattn eval needle`` asks it (:data:`QUESTION_ONE`, :data:`QUESTION_MANY`).

Parameters (all optional): ``docs`` (number of documents), ``seed``; for recall ``pairs`` and
``queries``; for needle ``needles``, ``queries``, ``words`` (haystack length in words, drawn
uniformly from ``[words/2, words]``) and ``digits`` (of each number, default 7). Documents
depend only on the spec, so a spec names one corpus, which the data cache's fingerprint
relies on.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

SYNTHETIC_PREFIX = "synthetic:"
GENERATOR_VERSION = 1
"""Part of a synthetic source's fingerprint: raise it whenever the documents a spec names change."""

NEEDLE_TEMPLATE = " The magic number of {city} is {number}."
QUESTION_ONE = (
    "\n\nQuestion: What is the magic number of {city}? Answer: The magic number of {city} is"
)
QUESTION_MANY = (
    "\n\nQuestion: What are the magic numbers of {cities}? Answer: The magic numbers are"
)
DIGITS = 7
"""Digits of a needle's number by default (the papers' needle uses 7)."""

CITIES = (
    "Amsterdam", "Athens", "Auckland", "Bangkok", "Barcelona", "Beijing", "Berlin", "Bogota",
    "Boston", "Brussels", "Budapest", "Buenos Aires", "Cairo", "Cape Town", "Chicago",
    "Copenhagen", "Dakar", "Delhi", "Dubai", "Dublin", "Edinburgh", "Florence", "Geneva",
    "Hanoi", "Havana", "Helsinki", "Hong Kong", "Istanbul", "Jakarta", "Johannesburg", "Kyiv",
    "Lagos", "Lima", "Lisbon", "London", "Los Angeles", "Madrid", "Manila", "Marrakesh",
    "Melbourne", "Mexico City", "Montreal", "Moscow", "Mumbai", "Munich", "Nairobi", "Oslo",
    "Paris", "Prague", "Quito", "Reykjavik", "Rome", "Santiago", "Seoul", "Shanghai",
    "Singapore", "Stockholm", "Sydney", "Taipei", "Tokyo", "Toronto", "Vancouver", "Vienna",
    "Warsaw", "Zurich",
)  # fmt: skip
"""The needle cities (65, all distinct)."""

HAYSTACK_SENTENCES = (
    "The morning train left the station a few minutes after the bell rang.",
    "A small boat drifted along the river while the sun rose over the hills.",
    "She opened the window and listened to the rain falling on the garden.",
    "The baker set out fresh bread on the counter before the shop opened.",
    "Children walked to school past the old library on the corner.",
    "The farmer checked the fences and counted the sheep in the field.",
    "A quiet wind moved through the tall grass near the edge of the lake.",
    "The teacher wrote a short list of words on the board for the class.",
    "Two friends shared a pot of tea and talked about their plans for the summer.",
    "The museum closed early because the workers were painting the main hall.",
    "He repaired the bicycle chain and rode slowly down the empty street.",
    "Clouds gathered in the evening and the lights came on along the harbour.",
    "The cat slept on a warm blanket beside the kitchen stove.",
    "A letter arrived with a stamp showing a mountain covered in snow.",
    "The gardener planted rows of beans and watered them before noon.",
    "Travellers waited at the bus stop, reading newspapers and checking the time.",
    "The old clock in the tower struck twelve as the market filled with people.",
    "Birds gathered on the roof of the barn after the storm had passed.",
    "The cook stirred the soup and added a pinch of salt and pepper.",
    "A long road wound between the fields toward the village in the valley.",
)
"""The synthetic haystack: plain sentences written for this library."""

RECALL_KEYS = (
    "apple", "bridge", "candle", "desert", "engine", "forest", "garden", "harbor", "island",
    "jacket", "kettle", "ladder", "marble", "needle", "orange", "pencil", "quarry", "river",
    "saddle", "tunnel", "valley", "window", "yellow", "anchor", "basket", "castle", "dragon",
    "feather", "glacier", "hammer", "lantern", "meadow", "mirror", "pepper", "rocket", "silver",
    "stone", "thunder", "violin", "wagon", "cotton", "copper", "falcon", "ginger", "helmet",
    "jungle", "lemon", "magnet", "napkin", "oyster", "planet", "rabbit", "shadow", "tiger",
    "velvet", "walnut", "zebra", "barrel", "cactus", "dolphin", "garlic", "insect", "parrot",
    "spider",
)  # fmt: skip
"""Keys of the recall task (64 distinct words)."""

DEFAULTS = {
    "recall": {"docs": 2000, "seed": 0, "pairs": 8, "queries": 8},
    "needle": {"docs": 2000, "seed": 0, "needles": 6, "queries": 2, "words": 120, "digits": DIGITS},
}
"""Parameters of each task and their defaults."""


@dataclass(frozen=True)
class SyntheticSpec:
    """A parsed ``synthetic:TASK?key=value&...`` source spec."""

    task: str
    params: dict[str, int]


def is_synthetic_spec(spec: str) -> bool:
    return spec.startswith(SYNTHETIC_PREFIX)


def parse_synthetic_spec(spec: str) -> SyntheticSpec:
    """Parse and check a synthetic source spec; ``ValueError`` names what is wrong."""
    body = spec[len(SYNTHETIC_PREFIX) :]
    task, _, query = body.partition("?")
    if task not in DEFAULTS:
        raise ValueError(
            f"bad synthetic source {spec!r}: task must be one of {', '.join(DEFAULTS)}"
        )
    params = dict(DEFAULTS[task])
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key not in params:
            raise ValueError(
                f"bad synthetic source {spec!r}: unknown parameter {key!r} "
                f"(accepted: {', '.join(params)})"
            )
        if not value.isdigit():
            raise ValueError(f"bad synthetic source {spec!r}: {key} must be an integer >= 0")
        params[key] = int(value)
    _check(spec, task, params)
    return SyntheticSpec(task, params)


def _check(spec: str, task: str, p: dict[str, int]) -> None:
    def fail(message: str) -> None:
        raise ValueError(f"bad synthetic source {spec!r}: {message}")

    if p["docs"] < 1:
        fail("docs must be >= 1")
    if task == "recall":
        if not 1 <= p["pairs"] <= len(RECALL_KEYS):
            fail(f"pairs must be in 1..{len(RECALL_KEYS)}")
        if not 1 <= p["queries"] <= p["pairs"]:
            fail("queries must be in 1..pairs")
    else:
        if not 1 <= p["needles"] <= len(CITIES):
            fail(f"needles must be in 1..{len(CITIES)}")
        if not 1 <= p["queries"] <= p["needles"]:
            fail("queries must be in 1..needles")
        if p["words"] < 2:
            fail("words must be >= 2")
        if not 1 <= p["digits"] <= 12:
            fail("digits must be in 1..12")


def needle_sentence(city: str, number: str) -> str:
    return NEEDLE_TEMPLATE.format(city=city, number=number)


def question(cities: list[str]) -> str:
    """The question about ``cities`` (the format ``diffattn eval needle`` uses)."""
    if len(cities) == 1:
        return QUESTION_ONE.format(city=cities[0])
    return QUESTION_MANY.format(cities=", ".join(cities[:-1]) + " and " + cities[-1])


def answer(numbers: list[str]) -> str:
    """The answer that follows :func:`question`."""
    if len(numbers) == 1:
        return f" {numbers[0]}."
    return " " + ", ".join(numbers[:-1]) + " and " + numbers[-1] + "."


def random_numbers(rng: random.Random, count: int, digits: int = DIGITS) -> list[str]:
    """``count`` distinct ``digits``-digit numbers."""
    if count > 9 * 10 ** (digits - 1):
        raise ValueError(f"cannot draw {count} distinct {digits}-digit numbers")
    numbers: list[str] = []
    while len(numbers) < count:
        number = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if number not in numbers:
            numbers.append(number)
    return numbers


def haystack_words(rng: random.Random, words: int) -> list[str]:
    """Haystack sentences (shuffled, repeated as needed) holding about ``words`` words."""
    sentences: list[str] = []
    count = 0
    while count < words:
        order = list(HAYSTACK_SENTENCES)
        rng.shuffle(order)
        for sentence in order:
            sentences.append(sentence)
            count += len(sentence.split())
            if count >= words:
                break
    return sentences


def recall_example(
    rng: random.Random, pairs: int, queries: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """One recall episode: the listed (key, value) pairs and the ``queries`` of them asked."""
    keys = rng.sample(RECALL_KEYS, pairs)
    values = [f"{rng.randrange(100):02d}" for _ in keys]
    listed = list(zip(keys, values, strict=True))
    return listed, rng.sample(listed, queries)


def recall_text(listed: list[tuple[str, str]], asked: list[tuple[str, str]]) -> str:
    """``"Pairs: k v, k v. Recall: k v, ..."`` (without the final period when ``asked`` ends
    with a key alone, ``(key, "")``: a prompt that asks for that key's value)."""
    pairs = ", ".join(f"{k} {v}" for k, v in listed)
    recalled = ", ".join(f"{k} {v}".rstrip() for k, v in asked)
    end = "" if asked and not asked[-1][1] else "."
    return f"Pairs: {pairs}. Recall: {recalled}{end}"


def _recall_document(rng: random.Random, p: dict[str, int]) -> str:
    return recall_text(*recall_example(rng, p["pairs"], p["queries"]))


def _needle_document(rng: random.Random, p: dict[str, int]) -> str:
    n = rng.randint(1, p["needles"])
    r = rng.randint(1, min(p["queries"], n))
    cities = rng.sample(CITIES, n)
    numbers = random_numbers(rng, n, p["digits"])
    sentences = haystack_words(rng, rng.randint(max(1, p["words"] // 2), p["words"]))
    pieces = [" " + s for s in sentences]
    for city, number in zip(cities, numbers, strict=True):
        pieces.insert(rng.randint(0, len(pieces)), needle_sentence(city, number))
    return "".join(pieces).lstrip() + question(cities[:r]) + answer(numbers[:r])


def synthetic_documents(spec: str) -> Iterator[str]:
    """The documents of a ``synthetic:`` spec, deterministic in the spec."""
    parsed = parse_synthetic_spec(spec)
    rng = random.Random(f"{parsed.task}:{parsed.params['seed']}")
    make = _recall_document if parsed.task == "recall" else _needle_document
    for _ in range(parsed.params["docs"]):
        yield make(rng, parsed.params)


# ----------------------------------------------------------------------------------------------
# token-level retrieval episodes (no tokenizer)
# ----------------------------------------------------------------------------------------------
IGNORE_INDEX = -100
BOS, SEP = 0, 1


@dataclass(frozen=True)
class RetrievalTask:
    """Token-level multi-query associative recall among look-alike distractors.

    After Zoology's MQAR (Arora et al. 2023): keys and values come from disjoint token ranges
    and the loss falls on the answers only. A key is two tokens, a *prefix* from a small set
    and a *suffix*; every queried key has ``lookalikes`` other keys in its context that share
    its prefix (distractors that match half of the query, so they compete for its
    attention, the situation DIFF V1 Fig 1 and Table 3 are about). The rest of the context is
    filler tokens (irrelevant context). Layout of every episode (fixed positions)::

        BOS | context: `pairs` triples (prefix suffix value) at random slots among filler |
        SEP | queries: `queries` triples (prefix suffix value)

    ``pairs`` is the difficulty axis (the role of the paper's needle count; more pairs means
    more keys competing for the query's attention in the same context length). The answer to
    a query is predicted at its suffix position (label on the value position, shifted by the
    model's loss as for next-token prediction).

    Token ranges: 0 BOS, 1 SEP, then ``filler``, ``prefixes``, ``suffixes``, ``values`` tokens
    in that order (``vocab_size`` is their total plus 2).
    """

    context: int = 64
    """Context tokens between BOS and SEP (pairs take 3 each, filler the rest)."""
    queries: int = 4
    lookalikes: int = 1
    """Keys sharing each queried key's prefix (look-alike distractors), when ``pairs`` allows."""
    filler: int = 16
    prefixes: int = 8
    suffixes: int = 16
    values: int = 32

    def __post_init__(self) -> None:
        for name in ("context", "queries", "filler", "prefixes", "suffixes", "values"):
            if getattr(self, name) < 1:
                raise ValueError(f"RetrievalTask.{name} must be >= 1, got {getattr(self, name)}")
        if self.lookalikes < 0:
            raise ValueError(f"RetrievalTask.lookalikes must be >= 0, got {self.lookalikes}")
        if self.queries > self.prefixes:
            raise ValueError("RetrievalTask: queries need as many distinct prefixes")
        if self.lookalikes + 1 > self.suffixes:
            raise ValueError("RetrievalTask: lookalikes + 1 keys need as many distinct suffixes")

    @property
    def vocab_size(self) -> int:
        return 2 + self.filler + self.prefixes + self.suffixes + self.values

    @property
    def seq_len(self) -> int:
        return 1 + self.context + 1 + 3 * self.queries

    def max_pairs(self) -> int:
        return min(self.context // 3, self.prefixes * self.suffixes)

    def check_pairs(self, pairs: int) -> None:
        if not self.queries <= pairs <= self.max_pairs():
            raise ValueError(
                f"retrieval: pairs must be in {self.queries}..{self.max_pairs()} (queries .. "
                f"context // 3) for context {self.context}, got {pairs}"
            )

    def token(self, kind: str, index: int) -> int:
        """The id of the ``index``-th token of ``kind`` (filler, prefix, suffix, value)."""
        sizes = {
            "filler": self.filler,
            "prefix": self.prefixes,
            "suffix": self.suffixes,
            "value": self.values,
        }
        if kind not in sizes:
            raise ValueError(f"unknown token kind {kind!r}")
        if not 0 <= index < sizes[kind]:
            raise ValueError(f"{kind} index {index} out of range 0..{sizes[kind] - 1}")
        return dict(zip(sizes, self.offsets(), strict=True))[kind] + index

    def offsets(self) -> tuple[int, int, int, int]:
        """The first id of the filler, prefix, suffix and value ranges: the ids :meth:`token`
        adds its index to, for code that builds many tokens."""
        filler = 2
        prefix = filler + self.filler
        suffix = prefix + self.prefixes
        return filler, prefix, suffix, suffix + self.suffixes


@dataclass
class RetrievalEpisodes:
    """A batch of episodes, as plain lists (``torch.tensor`` them for a model).

    ``answer_spans[b][q]`` is the (start, end) of the queried pair in the context (prefix,
    suffix, value); ``lookalike_spans[b][q]`` those of the pairs sharing its prefix;
    ``other_spans[b][q]`` the remaining pairs; ``query_positions[q]`` the position that
    predicts the q-th answer (its suffix), ``answers[b][q]`` the answer token.
    """

    input_ids: list[list[int]]
    labels: list[list[int]]
    pairs: list[int]
    query_positions: list[int]
    answers: list[list[int]]
    answer_spans: list[list[tuple[int, int]]]
    lookalike_spans: list[list[list[tuple[int, int]]]]
    other_spans: list[list[list[tuple[int, int]]]]


def retrieval_episode(task: RetrievalTask, rng: random.Random, pairs: int) -> dict[str, Any]:
    """One episode with ``pairs`` key–value pairs (see :class:`RetrievalTask`), as a dict of
    the fields of :class:`RetrievalEpisodes` for one row.

    Training draws 28,800 of these per run, so the body is written for speed (token offsets
    computed once, the generator's methods bound locally); the draws from ``rng`` and their
    order are part of the contract: a seed gives the same episodes in every version
    (``tests/test_retrieval_episodes.py`` pins digests of the stream)."""
    task.check_pairs(pairs)
    randrange = rng.randrange
    filler_at, prefix_at, suffix_at, value_at = task.offsets()
    # queried keys: distinct prefixes, each followed by its look-alikes (same prefix)
    per_query = min(task.lookalikes, (pairs - task.queries) // task.queries)
    keys: list[tuple[int, int]] = []
    queried: list[int] = []
    for prefix in rng.sample(range(task.prefixes), task.queries):
        queried.append(len(keys))
        keys.extend((prefix, s) for s in rng.sample(range(task.suffixes), 1 + per_query))
    used = set(keys)
    while len(keys) < pairs:  # the rest: any unused key (may share a prefix by chance)
        key = (randrange(task.prefixes), randrange(task.suffixes))
        if key not in used:
            used.add(key)
            keys.append(key)
    values = [randrange(task.values) for _ in keys]
    order = list(range(pairs))
    rng.shuffle(order)
    filler_len = task.context - 3 * pairs
    cuts = sorted(rng.choices(range(filler_len + 1), k=pairs))  # filler before each pair
    fillers = task.filler
    ids = [BOS]
    start = [0] * pairs
    placed = 0
    for cut, index in zip(cuts, order, strict=True):
        ids += [filler_at + randrange(fillers) for _ in range(cut - placed)]
        placed = cut
        start[index] = len(ids)
        prefix, suffix = keys[index]
        ids += (prefix_at + prefix, suffix_at + suffix, value_at + values[index])
    ids += [filler_at + randrange(fillers) for _ in range(filler_len - placed)]
    ids.append(SEP)
    labels = [IGNORE_INDEX] * len(ids)
    spans = [(begin, begin + 3) for begin in start]
    positions, answers, answer_spans, lookalike_spans, other_spans = [], [], [], [], []
    for index in rng.sample(queried, len(queried)):
        prefix, suffix = keys[index]
        value = value_at + values[index]
        ids += (prefix_at + prefix, suffix_at + suffix, value)
        labels += (IGNORE_INDEX, IGNORE_INDEX, value)
        positions.append(len(ids) - 2)
        answers.append(value)
        answer_spans.append(spans[index])
        lookalike_spans.append(
            [spans[k] for k in range(pairs) if k != index and keys[k][0] == prefix]
        )
        other_spans.append([spans[k] for k in range(pairs) if keys[k][0] != prefix])
    return {
        "input_ids": ids,
        "labels": labels,
        "query_positions": positions,
        "answers": answers,
        "answer_spans": answer_spans,
        "lookalike_spans": lookalike_spans,
        "other_spans": other_spans,
    }


def retrieval_batch(
    task: RetrievalTask, rng: random.Random, pairs: int | list[int], size: int
) -> RetrievalEpisodes:
    """``size`` episodes; ``pairs`` one count, or a list to draw each episode's count from
    uniformly (training covers the evaluation grid this way). All episodes share one layout,
    so ``query_positions`` is common to the batch."""
    rows = []
    counts = []
    for _ in range(size):
        count = pairs if isinstance(pairs, int) else rng.choice(pairs)
        counts.append(count)
        rows.append(retrieval_episode(task, rng, count))
    return RetrievalEpisodes(
        input_ids=[r["input_ids"] for r in rows],
        labels=[r["labels"] for r in rows],
        pairs=counts,
        query_positions=rows[0]["query_positions"] if rows else [],
        answers=[r["answers"] for r in rows],
        answer_spans=[r["answer_spans"] for r in rows],
        lookalike_spans=[r["lookalike_spans"] for r in rows],
        other_spans=[r["other_spans"] for r in rows],
    )


def retrieval_test_set(
    task: RetrievalTask, grid: list[int], episodes: int, seed: int
) -> dict[int, RetrievalEpisodes]:
    """The fixed test episodes: ``episodes`` per grid point, determined by ``seed`` (and the
    task) alone, so every model is measured on the same ones."""
    out = {}
    for pairs in grid:
        rng = random.Random(f"retrieval-test:{seed}:{pairs}:{task}")
        out[pairs] = retrieval_batch(task, rng, pairs, episodes)
    return out
