"""``diffattn eval needle``: multi-needle retrieval (DIFF V1 §3.4, Table 2, Fig 5) and the
attention the query puts on the answer and on the rest of the context (DIFF V1 Table 3).

Needles. Each needle is the sentence ``" The magic number of CITY is NUMBER."`` with a city
from :data:`CITIES` (never two needles with the same city) and a random 7-digit number
(``--digits``; never two needles with the same number). A sample has ``N`` needles
(``--needles``); the first ``R`` (``--queries``) are the answer needles, the others
distractors.

Prompt (``PROMPT_TEMPLATE``), built from token ids of each model's own tokenizer::

    [BOS if the tokenizer adds one] CONTEXT QUESTION

* ``CONTEXT``: the haystack's first tokens with the needles spliced in at token boundaries.
  The distractor needles go at random places (uniform, seeded); then the answer needles,
  together as one block, go at ``depth`` × (context length before the block), moved to the
  nearest boundary that does not split a distractor. The haystack is cut so that the whole
  prompt is exactly ``length`` tokens.
* ``QUESTION``, for R = 1: ``"\\n\\nQuestion: What is the magic number of CITY1? Answer: The
  magic number of CITY1 is"``; for R > 1: ``"\\n\\nQuestion: What are the magic numbers of
  CITY1, CITY2 and CITY3? Answer: The magic numbers are"``.

Because the pieces are joined as token ids, the prompt is exactly ``length`` tokens long and
every needle keeps the tokens it has alone.

Haystacks (``--haystack``): ``synthetic`` (plain sentences written for this module, shuffled
and repeated; the default), ``stdlib`` (the Python standard library documents of
:func:`diffattn.data.iter_documents`), or a text file or a directory (its files, sorted by
path, concatenated). A haystack shorter than needed is repeated.

Scoring. Greedy decoding of ``--max-new-tokens`` tokens (default ``10·R + 2``) with a KV
cache, samples of the same cell batched with left padding. A sample scores 1 when every
queried number appears, as a string of digits, in the decoded output; otherwise 0.

Attention (DIFF V1 Table 3), on the same prompts, one extra forward per sample under a
:class:`~diffattn.probe.SpanMass` capture of the applied map (softmax A; DIFF V1 A1 − λA2;
DIFF V2's and DiffLlama's differential map), row of the last prompt token:

* ``answer_mass``: Σ of the map over the answer needles' tokens;
* ``noise_mass``: Σ of the map over the context tokens outside every needle (BOS and the
  question excluded);
* ``total_mass``: Σ over every prompt token (1 for softmax maps; a check);

each the mean over layers and heads, then over samples. These are raw sums, not normalised.
Dex models (Dex Table 2): heads Dex adapted contribute their effective-attention row, the
least-squares estimate O' V⁺ of App. F.3 Eq. 6 (:func:`diffattn.dex.effective.effective_rows`);
the other heads their softmax row.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffattn.data.synthetic import (
    CITIES,
    DIGITS,
    HAYSTACK_SENTENCES,
    NEEDLE_TEMPLATE,
    QUESTION_MANY,
    QUESTION_ONE,
    question,
    random_numbers,
)
from diffattn.eval.common import (
    CommonOptions,
    EvalModel,
    TextTokenizer,
    batches,
    command_main,
    fingerprint,
    markdown_table,
    one_axes,
    progress,
    require_tokenizer,
    save_figure,
    seed_everything,
)
from diffattn.eval.text import context_limit
from diffattn.settings import Settings, setting, shared, takes_settings

NAME = "needle"
HELP = "multi-needle retrieval by depth and length, attention to answer and noise (DIFF Tab 2/3)"

PROMPT_TEMPLATE = "[BOS] CONTEXT(haystack + needles) QUESTION"
SYNTHETIC_SENTENCES = HAYSTACK_SENTENCES
"""The synthetic haystack (shared with the training source ``synthetic:needle``)."""


NEEDLE_COUNTS = "--needles and --queries must be at least 1"
PER_SAMPLE = "--samples, --batch-size and --max-new-tokens must be at least 1"


@dataclass(frozen=True)
class NeedleSettings(Settings):
    """The settings of ``diffattn eval needle`` (and of :func:`run`)."""

    needles: int = setting(
        8,
        min=1,
        error=NEEDLE_COUNTS,
        max=len(CITIES),
        max_error=f"--needles {{needles}} exceeds the {len(CITIES)} built-in cities",
        help="needles per prompt, N (default {default})",
    )
    queries: int = setting(
        1, min=1, error=NEEDLE_COUNTS, help="needles asked for, R (default {default})"
    )
    lengths: tuple[int, ...] = setting(
        (4096,),
        min=1,
        error="--lengths must be positive token counts, got {lengths}",
        help="prompt lengths in tokens (default {default})",
    )
    depths: tuple[float, ...] = setting(
        (0, 25, 50, 75, 100),
        min=0,
        max=100,
        error="--depths must be percentages in 0…100, got {depths}",
        help="answer depths in percent of the context (default {default})",
    )
    samples: int = setting(
        10, min=1, error=PER_SAMPLE, help="samples per (depth, length) cell (default {default})"
    )
    haystack: str = setting(
        "synthetic", help="synthetic (default), stdlib, or a text file or directory"
    )
    seed: int = shared(CommonOptions, "seed")
    batch_size: int = shared(CommonOptions, "batch_size", error=PER_SAMPLE)
    max_new_tokens: int | None = setting(
        None,
        min=1,
        error=PER_SAMPLE,
        help="tokens generated per sample (default (digits + 3)·R + 2)",
    )
    digits: int = setting(
        DIGITS,
        min=1,
        max=12,
        error="--digits must be in 1..12, got {digits}",
        report_last=True,
        help="digits of each number (default {default})",
    )
    attention: bool = setting(
        True, flag="--no-attention", help="skip the attention-to-answer / noise measurement"
    )


add_arguments = NeedleSettings.add_arguments


# --- samples ---------------------------------------------------------------------------------


@dataclass
class NeedleSample:
    """One sample, independent of any tokenizer: the same for every model."""

    depth: float  # percent
    length: int
    cities: list[str]  # the first ``queries`` are asked for
    numbers: list[str]
    queries: int
    distractor_places: list[float] = field(default_factory=list)  # fractions of the haystack

    def needle(self, i: int) -> str:
        return NEEDLE_TEMPLATE.format(city=self.cities[i], number=self.numbers[i])

    def question(self) -> str:
        return question(self.cities[: self.queries])

    @property
    def answers(self) -> list[str]:
        return self.numbers[: self.queries]


def make_samples(
    needles: int,
    queries: int,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int,
    seed: int,
    digits: int = DIGITS,
) -> dict[tuple[float, int], list[NeedleSample]]:
    """``samples`` samples per (depth, length) cell; unique cities and numbers per sample."""
    if needles > len(CITIES):
        raise ValueError(f"--needles {needles} exceeds the {len(CITIES)} built-in cities")
    rng = random.Random(seed)
    cells: dict[tuple[float, int], list[NeedleSample]] = {}
    for length in lengths:
        for depth in depths:
            cell = []
            for _ in range(samples):
                cities = rng.sample(CITIES, needles)
                numbers = random_numbers(rng, needles, digits)
                places = [rng.random() for _ in range(needles - queries)]
                cell.append(NeedleSample(depth, length, cities, numbers, queries, places))
            cells[(depth, length)] = cell
    return cells


# --- haystacks -------------------------------------------------------------------------------


def _synthetic_text(seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    while True:
        order = list(SYNTHETIC_SENTENCES)
        rng.shuffle(order)
        yield " ".join(order)


def haystack_texts(spec: str, seed: int = 0) -> Iterator[str]:
    """Endless chunks of haystack text for ``spec`` (repeated when the source runs out)."""
    if spec == "synthetic":
        yield from _synthetic_text(seed)
        return
    if spec == "stdlib":
        from diffattn.data import iter_documents

        def source() -> Iterator[str]:
            return iter_documents(["stdlib"])
    else:
        path = Path(spec)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            files = [path]
        else:
            raise ValueError(
                f"--haystack {spec!r}: not synthetic, stdlib, or an existing file or directory"
            )

        def source() -> Iterator[str]:
            for file in files:
                yield file.read_text(encoding="utf-8", errors="replace")

    while True:
        empty = True
        for text in source():
            if text.strip():
                empty = False
                yield text
        if empty:
            raise ValueError(f"--haystack {spec!r} holds no text")


def haystack_ids(tokenizer: TextTokenizer, spec: str, n_tokens: int, seed: int = 0) -> list[int]:
    """At least ``n_tokens`` token ids of the haystack."""
    ids: list[int] = []
    for text in haystack_texts(spec, seed):
        ids.extend(tokenizer.encode(text + "\n\n"))
        if len(ids) >= n_tokens:
            break
    return ids


# --- prompts ---------------------------------------------------------------------------------


@dataclass
class Prompt:
    ids: list[int]
    answer_span: tuple[int, int]  # the answer block (all answer needles), end exclusive
    needle_spans: list[tuple[int, int]]  # every needle, answer needles first
    context_span: tuple[int, int]  # CONTEXT (after BOS, before the question)


def build_prompt(sample: NeedleSample, tokenizer: TextTokenizer, haystack: Sequence[int]) -> Prompt:
    """The prompt of ``sample`` for ``tokenizer``, exactly ``sample.length`` tokens."""
    prefix = tokenizer.encode("", special=True)
    question = tokenizer.encode(sample.question())
    needle_ids = [tokenizer.encode(sample.needle(i)) for i in range(len(sample.cities))]
    fixed = len(prefix) + len(question) + sum(len(n) for n in needle_ids)
    room = sample.length - fixed
    if room < 1:
        raise ValueError(
            f"--lengths {sample.length} is too short: the needles and the question need "
            f"{fixed + 1} tokens with this tokenizer"
        )
    if len(haystack) < room:
        raise ValueError(f"haystack has {len(haystack)} tokens, {room} needed")
    hay = list(haystack[:room])
    # Distractors at random haystack boundaries (stable order for equal places).
    order = sorted(
        range(sample.queries, len(needle_ids)),
        key=lambda i: (round(sample.distractor_places[i - sample.queries] * room), i),
    )
    context: list[int] = []
    spans: dict[int, tuple[int, int]] = {}
    cut = 0
    for i in order:
        at = round(sample.distractor_places[i - sample.queries] * room)
        context.extend(hay[cut:at])
        cut = at
        spans[i] = (len(context), len(context) + len(needle_ids[i]))
        context.extend(needle_ids[i])
    context.extend(hay[cut:])
    # The answer block at the requested depth, not splitting a distractor.
    at = round(sample.depth / 100 * len(context))
    for a, b in spans.values():
        if a < at < b:
            at = a if at - a <= b - at else b
    block: list[int] = []
    for i in range(sample.queries):
        spans[i] = (at + len(block), at + len(block) + len(needle_ids[i]))
        block.extend(needle_ids[i])
    for i in range(sample.queries, len(needle_ids)):
        a, b = spans[i]
        if a >= at:
            spans[i] = (a + len(block), b + len(block))
    context = context[:at] + block + context[at:]
    offset = len(prefix)
    ids = prefix + context + question
    shifted = [(spans[i][0] + offset, spans[i][1] + offset) for i in range(len(needle_ids))]
    return Prompt(
        ids,
        (at + offset, at + offset + len(block)),
        shifted,
        (offset, offset + len(context)),
    )


# --- scoring and generation ------------------------------------------------------------------


def score(output: str, answers: Sequence[str]) -> int:
    """1 when every answer (a string of digits) occurs in ``output``, else 0."""
    return int(all(str(a) in output for a in answers))


@torch.no_grad()
def greedy(
    model: EvalModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int = 0
) -> list[list[int]]:
    """Greedy continuation of each prompt (left padding, KV cache); up to the first EOS."""
    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(list(p))
        mask[row, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    eos = model.tokenizer.eos_token_id if model.tokenizer else None
    out = model.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache = out.past_key_values
    generated: list[torch.Tensor] = []
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    last = positions[:, -1:]
    for step in range(max_new_tokens):
        token = out.logits[:, -1].argmax(-1)
        generated.append(token)
        if eos is not None:
            done |= token == eos
            if bool(done.all()):
                break
        if step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
        last = last + 1
        out = model.model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=last,
            past_key_values=cache,
            use_cache=True,
        )
        cache = out.past_key_values if out.past_key_values is not None else cache
    tokens = torch.stack(generated, 1).tolist() if generated else [[] for _ in prompts]
    result = []
    for row in tokens:
        if eos is not None and eos in row:
            row = row[: row.index(eos)]
        result.append(row)
    return result


# --- attention to answer and noise -----------------------------------------------------------


def attention_masses(span_result: dict[int, list[dict[str, torch.Tensor]]]) -> dict[str, float]:
    """Mean over layers and heads of a :class:`SpanMass` result whose spans are
    ``[answer block, context, whole prompt, needle 1, needle 2, …]`` (one forward, one query
    row): ``answer_mass``, ``noise_mass`` (context minus every needle) and ``total_mass``."""
    per_layer = []
    for calls in span_result.values():
        mass = calls[-1]["applied"].double()  # (B, H, rows, spans)
        per_layer.append(mass[0, :, -1, :].mean(0))  # mean over heads
    mean = torch.stack(per_layer).mean(0)  # mean over layers
    answer, context, total = (float(v) for v in mean[:3])
    needles = float(mean[3:].sum())
    return {"answer_mass": answer, "noise_mass": context - needles, "total_mass": total}


@torch.no_grad()
def measure_attention(model: EvalModel, prompt: Prompt) -> dict[str, float]:
    """DIFF Table 3 masses of ``prompt`` at its last token (see :func:`attention_masses`)."""
    from diffattn.dex import is_dex
    from diffattn.probe import Probe, SpanMass

    n = len(prompt.ids)
    spans = [prompt.answer_span, prompt.context_span, (0, n), *prompt.needle_spans]
    ids = torch.tensor([prompt.ids], device=model.device)
    if is_dex(model.model):  # Dex changes outputs, not maps: use its effective attention
        from diffattn.dex.effective import effective_rows

        rows = effective_rows(model.model, ids)  # per layer (H, S)
        per_layer = {
            layer: [
                {
                    "applied": torch.stack([row[:, a:b].sum(-1) for a, b in spans], -1)[
                        None, :, None, :
                    ]
                }
            ]
            for layer, row in enumerate(rows)
        }
        return attention_masses(per_layer)
    capture = SpanMass(spans=spans, query_positions=[n - 1])
    with Probe(model.model, [capture]):
        model.model(input_ids=ids)
    return attention_masses(capture.result())


# --- the experiment --------------------------------------------------------------------------


def build_prompts(
    model: EvalModel,
    cells: dict[tuple[float, int], list[NeedleSample]],
    haystack: str,
    seed: int,
    max_new_tokens: int,
) -> dict[tuple[float, int], list[Prompt]]:
    """Every cell's prompts for ``model``; ``ValueError`` when they do not fit its context."""
    tokenizer = require_tokenizer(model)
    longest = max(length for _, length in cells)
    limit = context_limit(model)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(
            f"--lengths {longest} + {max_new_tokens} new tokens exceeds {model.name}'s "
            f"context of {limit} tokens"
        )
    hay = haystack_ids(tokenizer, haystack, longest, seed)
    return {key: [build_prompt(s, tokenizer, hay) for s in cell] for key, cell in cells.items()}


def evaluate_model(
    model: EvalModel,
    cells: dict[tuple[float, int], list[NeedleSample]],
    prompts: dict[tuple[float, int], list[Prompt]],
    batch_size: int,
    max_new_tokens: int,
    attention: bool,
    quiet: bool,
) -> dict[str, Any]:
    tokenizer = require_tokenizer(model)
    lengths = sorted({length for _, length in cells})
    pad = tokenizer.eos_token_id or 0
    out_cells = []
    for (depth, length), cell in progress(
        list(cells.items()), len(cells), f"needle {model.name}", quiet
    ):
        start = time.perf_counter()
        cell_prompts = prompts[(depth, length)]
        outputs: list[str] = []
        for group in batches(cell_prompts, batch_size):
            for tokens in greedy(model, [p.ids for p in group], max_new_tokens, pad):
                outputs.append(tokenizer.decode(tokens))
        outcomes = [score(o, s.answers) for o, s in zip(outputs, cell, strict=True)]
        masses = [measure_attention(model, p) for p in cell_prompts] if attention else []
        record: dict[str, Any] = {
            "depth": depth,
            "length": length,
            "accuracy": sum(outcomes) / len(outcomes),
            "n": len(outcomes),
            "outcomes": outcomes,
            "outputs": outputs,
            "answers": [s.answers for s in cell],
            "prompt_tokens": [len(p.ids) for p in cell_prompts],
            "answer_positions": [p.answer_span[0] for p in cell_prompts],
        }
        if masses:
            for key in ("answer_mass", "noise_mass", "total_mass"):
                record[key] = sum(m[key] for m in masses) / len(masses)
            record["per_sample_attention"] = masses
        record["seconds"] = time.perf_counter() - start
        out_cells.append(record)
    by_length = {
        str(length): _mean([c["accuracy"] for c in out_cells if c["length"] == length])
        for length in lengths
    }
    by_depth_attention = {}
    if attention:
        for depth in sorted({c["depth"] for c in out_cells}):
            chosen = [c for c in out_cells if c["depth"] == depth]
            by_depth_attention[_label(depth)] = {
                k: _mean([c[k] for c in chosen]) for k in ("answer_mass", "noise_mass")
            }
    return {
        "cells": out_cells,
        "accuracy_by_length": by_length,
        "accuracy": _mean([c["accuracy"] for c in out_cells]),
        "attention_by_depth": by_depth_attention,
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _label(depth: float) -> str:
    return f"{depth:g}%"


@takes_settings(NeedleSettings)
def run(models: Sequence[EvalModel], settings: NeedleSettings, quiet: bool) -> dict[str, Any]:
    """Multi-needle retrieval of every model on the same samples (see the module docstring);
    ``settings``, or its fields by name (``run(models, needles=4)``)."""
    needles, queries, samples = settings.needles, settings.queries, settings.samples
    if queries > needles:
        raise ValueError(f"--queries {queries} exceeds --needles {needles}")
    digits, seed, batch_size = settings.digits, settings.seed, settings.batch_size
    max_new_tokens = settings.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = (digits + 3) * queries + 2
    lengths = [int(n) for n in settings.lengths]
    depths = [float(d) for d in settings.depths]
    seed_everything(seed)
    cells = make_samples(needles, queries, lengths, depths, samples, seed, digits)
    results: dict[str, Any] = {
        "prompt_template": PROMPT_TEMPLATE,
        "needle_template": NEEDLE_TEMPLATE,
        "question_template": QUESTION_ONE if queries == 1 else QUESTION_MANY,
        "max_new_tokens": max_new_tokens,
        "samples_fingerprint": fingerprint(
            [[s.cities, s.numbers, s.distractor_places] for c in cells.values() for s in c]
        ),
        "models": {},
    }
    # Every model's prompts first, so that a bad setting fails before any decoding.
    haystack = settings.haystack
    prompts = [build_prompts(m, cells, haystack, seed, max_new_tokens) for m in models]
    for model, model_prompts in zip(models, prompts, strict=True):
        results["models"][model.name] = evaluate_model(
            model, cells, model_prompts, batch_size, max_new_tokens, settings.attention, quiet
        )
    return results


# --- outputs ---------------------------------------------------------------------------------


def plot_heatmap(name: str, result: dict[str, Any], path: Path) -> Path:
    """Accuracy by depth (y) and length (x), annotated, like DIFF V1 Fig 5."""
    depths = sorted({c["depth"] for c in result["cells"]})
    lengths = sorted({c["length"] for c in result["cells"]})
    grid = [[math.nan] * len(lengths) for _ in depths]
    for c in result["cells"]:
        grid[depths.index(c["depth"])][lengths.index(c["length"])] = c["accuracy"]
    fig, ax = one_axes(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 1.8))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [_label(d) for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("answer depth")
    ax.set_title(f"Multi-needle retrieval: {name}")
    fig.colorbar(image, ax=ax, label="accuracy")
    return save_figure(fig, path)


def report(results: dict[str, Any]) -> str:
    lengths = sorted({c["length"] for r in results["models"].values() for c in r["cells"]})
    rows = [
        (name, *[r["accuracy_by_length"][str(n)] for n in lengths], r["accuracy"])
        for name, r in results["models"].items()
    ]
    text = (
        "## Multi-needle retrieval (DIFF V1 Table 2)\n\n"
        + markdown_table(["model", *[f"{n} tokens" for n in lengths], "overall"], rows)
        + "\nMean accuracy over depths per length; a sample counts 1 when every queried number "
        "appears in the greedy output.\n"
    )
    attention = {n: r["attention_by_depth"] for n, r in results["models"].items()}
    if any(attention.values()):
        depths = sorted({d for a in attention.values() for d in a}, key=lambda s: float(s[:-1]))
        rows = []
        for name, by_depth in attention.items():
            for key, label in (("answer_mass", "answer"), ("noise_mass", "noise")):
                rows.append((name, label, *[by_depth[d][key] for d in depths]))
        text += (
            "\n## Attention to answer and noise (DIFF V1 Table 3)\n\n"
            + markdown_table(["model", "mass", *depths], rows)
            + "\nRaw sums of the applied map at the last prompt token, mean over layers, heads "
            "and samples: answer = the answer needles' tokens; noise = context tokens outside "
            "every needle.\n"
        )
    return text


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "model"


def figures(results: dict[str, Any], out: Path) -> list[Path]:
    """One accuracy heatmap per model."""
    return [
        plot_heatmap(name, r, out / f"needle_{_safe(name)}.png")
        for name, r in results["models"].items()
    ]


def main(args: Any) -> int:
    return command_main(args, NAME, NeedleSettings, run, report, figures, "samples_fingerprint")
