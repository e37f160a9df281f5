"""``diffattn eval icl``: many-shot in-context classification (DIFF V1 §3.5, Fig 6) and its
robustness to the order of the demonstrations (DIFF V1 Fig 7 and App. F Fig 11), after the
protocol of Bertsch et al. 2024 with constrained decoding (Ratner et al. 2023).

Prompt, built from token ids of each model's own tokenizer (data and formats:
:mod:`diffattn.eval.icl_data`)::

    [BOS] DEMO_1 SEP DEMO_2 SEP … DEMO_k SEP INPUT_PREFIX text LABEL_PREFIX

with ``DEMO = INPUT_PREFIX text LABEL_PREFIX " " label`` (e.g. ``Question: …\\nType: human``)
and ``SEP = "\\n\\n"``. The answer is decoded over the label set only: every label is tokenized
as ``" " + label`` followed by the first token of ``SEP`` (its terminator; so no label is a
prefix of another) and the sequences form a token trie (:mod:`diffattn.eval.label_trie`).
``--decoding greedy`` (default) takes at each step the most likely token among the trie
node's children until a leaf; ``scored`` takes the label of highest Σ log p. A prediction is
right when it is the gold label exactly; accuracy is the share of right predictions.

Shots (``--shots``): the demonstrations are one seeded shuffle of the training split, and ``k``
shots are its first ``k`` (so a larger ``k`` adds demonstrations to the same ones); ``max`` is
the most that fit the token budget (``--budget``, default the model's context) with room left
for the longest test item and the longest label. A number of shots that does not fit is an
error.

Order (``--arrangements``, ``--permutations K``): the same ``k`` demonstrations are put in
``K`` orders, seeded: ``random`` shuffles them; ``alternating`` cycles through the classes
(class order and the order within each class shuffled), as in DIFF V1 Fig 7b. Per shot count
the report gives the mean, standard deviation, best, worst and best − worst margin of the
accuracy over the ``K`` orders.

The demonstration prefix is run once per prompt and every batch of test items continues from
a copy of its KV cache (``--no-cache`` re-runs prefix + item in full: the reference).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffattn.eval.common import (
    CommonOptions,
    EvalModel,
    TextTokenizer,
    batches,
    command_main,
    fingerprint,
    markdown_table,
    one_axes,
    panel_row,
    progress,
    require_tokenizer,
    save_axes,
    save_figure,
    seed_everything,
)
from diffattn.eval.icl_data import DATASETS, Example, ICLData, ICLFormat, load_dataset
from diffattn.eval.label_trie import LabelTrie, SharedPrefix, greedy_labels, label_logprobs
from diffattn.eval.text import context_limit
from diffattn.settings import Settings, setting, shared, takes_settings

NAME = "icl"
HELP = "many-shot in-context classification by shots and its robustness to order (DIFF Fig 6/7)"
ARRANGEMENTS = ("random", "alternating")
DECODINGS = ("greedy", "scored")
COUNTS = "--test-items, --permutations and --batch-size must be at least 1"


@dataclass(frozen=True)
class IclSettings(Settings):
    """The settings of ``diffattn eval icl`` (and of :func:`run`; ``shots`` are counts or
    ``"max"``, as text or numbers)."""

    dataset: str = setting("synthetic", choices=tuple(sorted(DATASETS)), help="default: {default}")
    data: str | None = setting(None, help="directory of jsonl or save_to_disk files, or hub")
    classes: int = setting(20, help="classes of the synthetic task (default {default})")
    shots: tuple[str, ...] = setting(
        ("1", "4", "16", "64", "max"),
        help="demonstration counts, or max to fill the budget (default {default})",
    )
    budget: int | None = setting(
        None,
        min=2,
        error="--budget must be at least 2 tokens, got {budget}",
        help="prompt tokens (default: the model's context)",
    )
    test_items: int = setting(
        100, min=1, error=COUNTS, help="test items per prompt (default {default})"
    )
    arrangements: tuple[str, ...] = setting(
        ("random",),
        choices=ARRANGEMENTS,
        error=f"--arrangements must be among {', '.join(ARRANGEMENTS)}",
        help="demonstration orders: random and/or alternating by class (default {default})",
    )
    permutations: int = setting(
        1, min=1, error=COUNTS, help="orders per shot count, K (default {default})"
    )
    decoding: str = setting(
        "greedy",
        choices=DECODINGS,
        error=f"--decoding must be one of {', '.join(DECODINGS)}, got {{decoding!r}}",
    )
    use_cache: bool = setting(
        True,
        flag="--no-cache",
        help="re-run the demonstrations for every item (the reference; slow)",
    )
    batch_size: int = shared(CommonOptions, "batch_size", error=COUNTS)
    seed: int = shared(CommonOptions, "seed")

    def check(self) -> None:
        """``shots`` as :func:`parse_shots` reads them, then every setting's bounds."""
        parse_shots(self.shots)
        super().check()


add_arguments = IclSettings.add_arguments


# --- demonstrations and prompts ---------------------------------------------------------------


def parse_shots(shots: Sequence[Any]) -> list[int | str]:
    """``--shots`` as positive ints and ``"max"``, in the given order (duplicates dropped)."""
    out: list[int | str] = []
    for value in shots:
        text = str(value).strip().lower()
        if text == "max":
            parsed: int | str = "max"
        elif text.isdigit() and int(text) >= 0:
            parsed = int(text)
        else:
            raise ValueError(f"--shots takes non-negative counts or max, got {value!r}")
        if parsed not in out:
            out.append(parsed)
    if not out:
        raise ValueError("--shots is empty")
    return out


def arrange(demos: Sequence[Example], arrangement: str, rng: random.Random) -> list[Example]:
    """One order of ``demos``: shuffled (``random``) or cycling through the classes
    (``alternating``: class order and order within each class shuffled)."""
    if arrangement == "random":
        order = list(demos)
        rng.shuffle(order)
        return order
    if arrangement != "alternating":
        raise ValueError(f"--arrangements must be among {', '.join(ARRANGEMENTS)}")
    by_class: dict[str, list[Example]] = {}
    for demo in demos:
        by_class.setdefault(demo.label, []).append(demo)
    classes = sorted(by_class)
    rng.shuffle(classes)
    for label in classes:
        rng.shuffle(by_class[label])
    order = []
    while any(by_class.values()):
        for label in classes:
            if by_class[label]:
                order.append(by_class[label].pop())
    return order


class PromptBuilder:
    """One model's token ids of demonstrations, test items and labels."""

    def __init__(self, tokenizer: TextTokenizer, fmt: ICLFormat, labels: Sequence[str]) -> None:
        self.tokenizer, self.format = tokenizer, fmt
        self.bos = tokenizer.encode("", special=True)
        self.separator = tokenizer.encode(fmt.separator)
        if not self.separator:
            raise ValueError("the demonstration separator encodes to no token")
        for label in labels:
            if fmt.separator in label:
                raise ValueError(f"label {label!r} contains the separator {fmt.separator!r}")
        self.label_ids = {label: tokenizer.encode(" " + label) for label in labels}
        self.trie = LabelTrie(
            {label: [*ids, self.separator[0]] for label, ids in self.label_ids.items()}
        )
        self._cache: dict[str, list[int]] = {}

    def item(self, text: str) -> list[int]:
        if text not in self._cache:
            fmt = self.format
            self._cache[text] = self.tokenizer.encode(fmt.input_prefix + text + fmt.label_prefix)
        return self._cache[text]

    def demo(self, example: Example) -> list[int]:
        return [*self.item(example.text), *self.label_ids[example.label], *self.separator]

    def prefix(self, demos: Sequence[Example]) -> list[int]:
        ids = list(self.bos)
        for demo in demos:
            ids.extend(self.demo(demo))
        return ids


def shot_counts(
    builder: PromptBuilder,
    pool: Sequence[Example],
    tests: Sequence[Example],
    shots: Sequence[int | str],
    limit: int,
    model_name: str,
) -> dict[str, int]:
    """Each ``--shots`` value (as a string) → demonstrations, checked against ``limit``."""
    room = max(len(builder.item(t.text)) for t in tests) + builder.trie.depth
    used = len(builder.bos)
    fits = 0  # most demonstrations of the pool that fit
    for demo in pool:
        used += len(builder.demo(demo))
        if used + room > limit:
            break
        fits += 1
    if len(builder.bos) + room > limit:
        raise ValueError(f"--budget {limit}: a test item alone does not fit ({model_name})")
    counts = {}
    for value in shots:
        if value == "max":
            counts["max"] = fits
            continue
        if value > len(pool):
            raise ValueError(f"--shots {value} exceeds the {len(pool)} training examples")
        if value > fits:
            raise ValueError(
                f"--shots {value} does not fit {model_name}'s budget of {limit} tokens "
                f"(at most {fits} demonstrations fit; use max)"
            )
        counts[str(value)] = value
    return counts


# --- the experiment ---------------------------------------------------------------------------


def predict(
    model: EvalModel,
    builder: PromptBuilder,
    demos: Sequence[Example],
    tests: Sequence[Example],
    decoding: str,
    use_cache: bool,
    batch_size: int,
) -> tuple[list[str], int, bool]:
    """Predicted labels of ``tests`` after the demonstrations; prefix tokens; cache used."""
    prefix_ids = builder.prefix(demos)
    prefix = SharedPrefix(model.model, prefix_ids, use_cache)
    predictions: list[str] = []
    items = [builder.item(t.text) for t in tests]
    if decoding == "greedy":
        for group in batches(items, batch_size):
            predictions.extend(greedy_labels(prefix, group, builder.trie))
    else:
        for item in items:
            scores = label_logprobs(prefix, item, builder.trie, batch_size)
            predictions.append(max(scores, key=lambda label: scores[label]))
    return predictions, len(prefix_ids), prefix.cached or not prefix_ids


def _summary(accuracies: Sequence[float]) -> dict[str, float]:
    mean = sum(accuracies) / len(accuracies)
    std = (
        math.sqrt(sum((a - mean) ** 2 for a in accuracies) / (len(accuracies) - 1))
        if len(accuracies) > 1
        else math.nan
    )
    return {
        "mean": mean,
        "std": std,
        "best": max(accuracies),
        "worst": min(accuracies),
        "margin": max(accuracies) - min(accuracies),
    }


def evaluate_model(
    model: EvalModel,
    data: ICLData,
    pool: Sequence[Example],
    tests: Sequence[Example],
    shots: Sequence[int | str],
    budget: int | None,
    arrangements: Sequence[str],
    permutations: int,
    decoding: str,
    use_cache: bool,
    batch_size: int,
    seed: int,
    quiet: bool,
) -> dict[str, Any]:
    builder = PromptBuilder(require_tokenizer(model), data.format, data.labels)
    limit = budget or context_limit(model)
    if limit is None:
        raise ValueError(f"{model.name}: no context length known; give --budget")
    if budget is not None and context_limit(model) and budget > context_limit(model):
        raise ValueError(
            f"--budget {budget} exceeds {model.name}'s context of {context_limit(model)} tokens"
        )
    counts = shot_counts(builder, pool, tests, shots, limit, model.name)
    jobs = [(a, s, p) for a in arrangements for s in counts for p in range(permutations)]
    runs, cached = [], True
    for arrangement, shot, permutation in progress(jobs, len(jobs), f"icl {model.name}", quiet):
        start = time.perf_counter()
        rng = random.Random(f"order-{seed}-{arrangement}-{permutation}")
        demos = arrange(pool[: counts[shot]], arrangement, rng)
        predictions, prefix_tokens, used_cache = predict(
            model, builder, demos, tests, decoding, use_cache, batch_size
        )
        cached = cached and used_cache
        correct = [int(p == t.label) for p, t in zip(predictions, tests, strict=True)]
        accuracy = sum(correct) / len(correct)
        runs.append(
            {
                "arrangement": arrangement,
                "shots": shot,
                "demonstrations": counts[shot],
                "permutation": permutation,
                "prefix_tokens": prefix_tokens,
                "accuracy": accuracy,
                "stderr": math.sqrt(accuracy * (1 - accuracy) / len(correct)),
                "correct": correct,
                "predictions": predictions,
                "seconds": time.perf_counter() - start,
            }
        )
    summary: dict[str, dict[str, Any]] = {}
    for arrangement in arrangements:
        summary[arrangement] = {}
        for shot in counts:
            chosen = [r for r in runs if r["arrangement"] == arrangement and r["shots"] == shot]
            summary[arrangement][shot] = {
                **_summary([r["accuracy"] for r in chosen]),
                "demonstrations": counts[shot],
                "prefix_tokens": chosen[0]["prefix_tokens"],
            }
    return {
        "budget": limit,
        "label_tokens": {label: len(ids) for label, ids in builder.label_ids.items()},
        "kv_cache": cached,
        "runs": runs,
        "summary": summary,
    }


@takes_settings(IclSettings)
def run(models: Sequence[EvalModel], settings: IclSettings, quiet: bool) -> dict[str, Any]:
    """Many-shot ICL accuracy of every model on the same demonstrations and test items
    (``settings``, or its fields by name: ``run(models, shots=[0, 4], budget=512)``)."""
    shots = parse_shots(settings.shots)
    dataset, seed, test_items = settings.dataset, settings.seed, settings.test_items
    seed_everything(seed)
    loaded = load_dataset(dataset, settings.data, classes=settings.classes, seed=seed)
    pool = list(loaded.train)
    random.Random(f"pool-{seed}").shuffle(pool)
    tests = random.Random(f"test-{seed}").sample(loaded.test, min(test_items, len(loaded.test)))
    counts: dict[str, int] = {}
    for t in tests:
        counts[t.label] = counts.get(t.label, 0) + 1
    results: dict[str, Any] = {
        "dataset": dataset,
        "format": vars(loaded.format),
        "labels": loaded.labels,
        "classes": len(loaded.labels),
        "chance": 1 / len(loaded.labels),
        "majority": max(counts.values()) / len(tests),
        "test_items": len(tests),
        "gold": [t.label for t in tests],
        "data_fingerprint": fingerprint(
            [[e.text, e.label] for e in pool] + [[e.text, e.label] for e in tests]
        ),
        "models": {},
    }
    for model in models:
        results["models"][model.name] = evaluate_model(
            model,
            loaded,
            pool,
            tests,
            shots,
            settings.budget,
            settings.arrangements,
            settings.permutations,
            settings.decoding,
            settings.use_cache,
            settings.batch_size,
            seed,
            quiet,
        )
    return results


# --- outputs ----------------------------------------------------------------------------------


def plot_accuracy(results: dict[str, Any], path: Path) -> Path:
    """Accuracy against demonstrations per model and arrangement (DIFF V1 Fig 6)."""
    fig, ax = one_axes(figsize=(6.5, 4))
    for name, r in results["models"].items():
        for arrangement, by_shot in r["summary"].items():
            points = sorted(
                (max(s["demonstrations"], 0.5), s["mean"], s["worst"], s["best"])
                for s in by_shot.values()
            )
            xs, means, worst, best = (list(v) for v in zip(*points, strict=True))
            line = ax.plot(xs, means, marker="o", label=f"{name} ({arrangement})")[0]
            ax.fill_between(xs, worst, best, color=line.get_color(), alpha=0.15)
    ax.axhline(results["chance"], color="grey", ls=":", label="chance")
    ax.set_xscale("log")
    return save_axes(
        fig,
        ax,
        path,
        f"Many-shot ICL: {results['dataset']} (DIFF V1 Fig 6)",
        "demonstrations (0 shots drawn at 0.5)",
        "accuracy",
        legend_size=8,
    )


def plot_robustness(results: dict[str, Any], path: Path) -> Path | None:
    """Accuracy of each order at the most demonstrations, best and worst dashed (DIFF V1
    Fig 7 / Fig 11); ``None`` with a single order."""
    names = list(results["models"])
    first = results["models"][names[0]]
    if len({r["permutation"] for r in first["runs"]}) < 2:
        return None
    arrangements = list(first["summary"])
    fig, axes = panel_row(
        len(arrangements),
        f"ICL robustness to order: {results['dataset']} (DIFF V1 Fig 7)",
        (3 + 2.2 * len(names), 4),
    )
    for ax, arrangement in zip(axes, arrangements, strict=True):
        for x, name in enumerate(names):
            r = results["models"][name]
            top = max(
                r["summary"][arrangement],
                key=lambda s: r["summary"][arrangement][s]["demonstrations"],
            )
            accs = [
                run["accuracy"]
                for run in r["runs"]
                if run["arrangement"] == arrangement and run["shots"] == top
            ]
            ax.scatter([x] * len(accs), accs, alpha=0.7)
            for value in (max(accs), min(accs)):
                ax.hlines(value, x - 0.3, x + 0.3, linestyles="dashed", colors="k", lw=1)
            ax.annotate(f"Δ={max(accs) - min(accs):.3f}", (x, max(accs)), xytext=(0, 6),
                        textcoords="offset points", ha="center", fontsize=8)  # fmt: skip
        ax.set_xticks(range(len(names)), names, rotation=15)
        ax.set_xlim(-0.7, len(names) - 0.3)
        ax.set_ylabel("accuracy")
        ax.set_title(f"{arrangement} order")
        ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, path)


def report(results: dict[str, Any]) -> str:
    text = (
        f"## Many-shot in-context learning: {results['dataset']} (DIFF V1 Fig 6)\n\n"
        f"{results['classes']} classes, {results['test_items']} test items; chance "
        f"{results['chance']:.3f}, majority class {results['majority']:.3f}.\n"
    )
    for arrangement in next(iter(results["models"].values()))["summary"]:
        rows = []
        for name, r in results["models"].items():
            for shot, s in r["summary"][arrangement].items():
                rows.append(
                    (name, shot, s["demonstrations"], s["prefix_tokens"], s["mean"], s["std"],
                     s["worst"], s["best"], s["margin"])
                )  # fmt: skip
        text += f"\n### {arrangement} order\n\n" + markdown_table(
            ["model", "shots", "demos", "prompt tokens", "accuracy", "± std", "worst", "best",
             "margin"],
            rows,
        )  # fmt: skip
    return text + (
        "\nAccuracy: mean over the orders (--permutations); ± std, worst, best and margin "
        "(best − worst) are over the orders (— with one order). Exact label match under "
        "constrained decoding.\n"
    )


def figures(results: dict[str, Any], out: Path) -> list[Path | None]:
    return [
        plot_accuracy(results, out / "icl_accuracy.png"),
        plot_robustness(results, out / "icl_robustness.png"),
    ]


def main(args: Any) -> int:
    return command_main(args, NAME, IclSettings, run, report, figures)
