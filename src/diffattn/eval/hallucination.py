"""``diffattn eval hallucination``: contextual hallucination in summarization and question
answering, judged per output (DIFF V1 §3.6, Table 4; protocol of Lookback Lens, Chuang et al.
2024).

Data (``--data FILE_OR_DIR ...``): LongBench-format jsonl, one dataset per file (the file name
without ``.jsonl`` names it; a directory contributes each ``*.jsonl`` in it). Each line is an
object with

* ``context`` (str, required): the document(s) to summarize or answer from;
* ``input`` (str): the question; empty or missing for summarization;
* ``answers`` (list of str, required, at least one): the reference answers or summaries;
* ``_id`` (optional): kept in the results; other LongBench fields are ignored.

XSum, CNN/DM or any other set in this schema works the same way (``context`` = article,
``answers`` = [reference summary], no ``input``). The task of a dataset (``--task auto``) is
summarization when its name is one of :data:`SUMMARIZATION` or none of its lines has an
``input``, else QA. ``--samples N`` (default 100, as in the paper) draws N lines per dataset,
seeded, the same for every model.

Prompts (:data:`QA_TEMPLATE`, :data:`SUMMARY_TEMPLATE`) are built from token ids of each model's
own tokenizer; a context too long for ``--max-input-tokens`` (default: the model's context
minus ``--max-new-tokens``) loses its middle tokens (head and tail kept, as LongBench does).
Each model decodes greedily up to ``--max-new-tokens`` tokens (KV cache, left-padded batches,
stop at EOS); the output is cut at the first ``--stop`` string (default a blank line) and
stripped.

The judge (:mod:`diffattn.eval.judge`; ``--judge api`` or ``--judge MODEL_DIR``) gives one
binary verdict per output. Accuracy per dataset = the share of outputs judged free of
hallucination among the parsed verdicts, with its standard error √(p(1−p)/n); unparsed
verdicts are counted apart.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffattn.eval.common import (
    CommonOptions,
    EvalModel,
    batches,
    fingerprint,
    finish,
    json_lines,
    markdown_table,
    models_from_args,
    one_axes,
    progress,
    require_tokenizer,
    save_figure,
    seed_everything,
)
from diffattn.eval.judge import HTTPJudge, LocalJudge, judge_prompt, parse_verdict
from diffattn.eval.needle import greedy
from diffattn.eval.text import context_limit
from diffattn.settings import Settings, setting, shared

NAME = "hallucination"
HELP = "judged hallucination-free accuracy in summarization and QA (DIFF Tab 4, Lookback Lens)"
SUMMARIZATION = ("xsum", "cnn_dailymail", "cnndm", "multi_news", "gov_report", "qmsum")
QA_TEMPLATE = (
    "Answer the question using only the passages below. Give a short answer.\n\n"
    "{context}\n\nQuestion: {question}\nAnswer:"
)
SUMMARY_TEMPLATE = "Write a short summary of the document below.\n\n{context}\n\nSummary:"
TASKS = ("auto", "qa", "summarization")
PER_SAMPLE = "--samples, --max-new-tokens and --batch-size must be at least 1"


@dataclass(frozen=True)
class HallucinationSettings(Settings):
    """The settings of ``diffattn eval hallucination`` (and of :func:`run`; the judge options
    are the command's, :func:`run` takes the judge itself)."""

    data: tuple[str, ...] = setting(
        (), required=True, help="LongBench-format jsonl files or directories"
    )
    task: str = setting("auto", choices=TASKS, help="default: {default}")
    samples: int = setting(100, min=1, error=PER_SAMPLE, help="per dataset (default {default})")
    max_new_tokens: int = setting(64, min=1, error=PER_SAMPLE, help="default {default}")
    max_input_tokens: int | None = setting(
        None, help="prompt tokens (default: the model's context − --max-new-tokens)"
    )
    stop: str = setting("\n\n", help="cut outputs at this string (default a blank line)")
    judge: str = setting(
        "api",
        command_only=True,
        help="api (OpenAI-compatible endpoint from DIFFATTN_JUDGE_URL, DIFFATTN_JUDGE_MODEL, "
        "DIFFATTN_JUDGE_API_KEY) or a local model directory (default: {default})",
    )
    judge_timeout: float = setting(HTTPJudge.timeout, command_only=True, help="seconds per request")
    judge_attempts: int = setting(HTTPJudge.attempts, command_only=True, help="tries per request")
    judge_document_chars: int = setting(
        8000, help="document characters shown to the judge (0: all; default {default})"
    )
    batch_size: int = shared(CommonOptions, "batch_size", error=PER_SAMPLE)
    seed: int = shared(CommonOptions, "seed")


add_arguments = HallucinationSettings.add_arguments


# --- data -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    dataset: str
    task: str
    context: str
    question: str
    answers: tuple[str, ...]
    id: str = ""


def _files(paths: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for spec in paths:
        path = Path(spec)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise ValueError(f"--data {spec}: no .jsonl file in this directory")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"--data {spec}: no such file or directory")
    return files


def _dataset(path: Path, task: str) -> list[Sample]:
    rows = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, row in json_lines(
        lines, lambda number, msg: f"{path}:{number}: not a JSON object ({msg})"
    ):
        answers = row.get("answers")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(row.get("context"), str) or not answers:
            raise ValueError(
                f"{path}:{number}: needs a string 'context' and non-empty 'answers' "
                "(LongBench format)"
            )
        rows.append((row, [str(a) for a in answers], number))
    if not rows:
        raise ValueError(f"{path}: no samples")
    name = path.name.removesuffix(".jsonl")
    if task == "auto":
        has_input = any(str(row.get("input") or "").strip() for row, _, _ in rows)
        task = "summarization" if name.lower() in SUMMARIZATION or not has_input else "qa"
    return [
        Sample(
            name,
            task,
            row["context"],
            str(row.get("input") or "").strip(),
            tuple(answers),
            str(row.get("_id", number)),
        )
        for row, answers, number in rows
    ]


def load_samples(
    paths: Sequence[str],
    task: str = HallucinationSettings.task,
    samples: int = HallucinationSettings.samples,
    seed: int = 0,
) -> dict[str, list[Sample]]:
    """Up to ``samples`` samples of every dataset, drawn from ``seed`` (see the docstring)."""
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    out: dict[str, list[Sample]] = {}
    for path in _files(paths):
        data = _dataset(path, task)
        name = data[0].dataset
        if name in out:
            raise ValueError(f"--data: two datasets named {name!r}")
        chosen = random.Random(f"{seed}-{name}").sample(data, min(samples, len(data)))
        out[name] = chosen
    return out


# --- prompts and generation -------------------------------------------------------------------


def build_prompt(sample: Sample, tokenizer: Any, max_input_tokens: int) -> list[int]:
    """Token ids of the prompt; the context loses middle tokens when it does not fit."""
    template = QA_TEMPLATE if sample.task == "qa" else SUMMARY_TEMPLATE
    head_text, tail_text = template.split("{context}")
    head = tokenizer.encode(head_text, special=True)
    tail = tokenizer.encode(tail_text.format(question=sample.question))
    context = tokenizer.encode(sample.context)
    room = max_input_tokens - len(head) - len(tail)
    if room < 2:
        raise ValueError(
            f"--max-input-tokens {max_input_tokens} leaves no room for the context "
            f"({len(head) + len(tail)} tokens of instructions and question)"
        )
    if len(context) > room:
        keep = room // 2
        context = context[:keep] + context[len(context) - (room - keep) :]
    return head + context + tail


def clean_output(text: str, stop: str) -> str:
    if stop and stop in text:
        text = text[: text.index(stop)]
    return text.strip()


def generate(
    model: EvalModel,
    samples: Sequence[Sample],
    max_new_tokens: int,
    max_input_tokens: int | None,
    stop: str,
    batch_size: int,
    quiet: bool,
) -> list[str]:
    tokenizer = require_tokenizer(model)
    limit = context_limit(model)
    if max_input_tokens is None:
        if limit is None:
            raise ValueError(f"{model.name}: no context length known; give --max-input-tokens")
        max_input_tokens = limit - max_new_tokens
    elif limit is not None and max_input_tokens + max_new_tokens > limit:
        raise ValueError(
            f"--max-input-tokens {max_input_tokens} + --max-new-tokens {max_new_tokens} "
            f"exceeds {model.name}'s context of {limit} tokens"
        )
    prompts = [build_prompt(s, tokenizer, max_input_tokens) for s in samples]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less padding
    outputs: list[str] = [""] * len(prompts)
    groups = list(batches(order, batch_size))
    pad = tokenizer.eos_token_id or 0
    for group in progress(groups, len(groups), f"generate {model.name}", quiet):
        for i, tokens in zip(
            group, greedy(model, [prompts[i] for i in group], max_new_tokens, pad), strict=True
        ):
            outputs[i] = clean_output(tokenizer.decode(tokens), stop)
    return outputs


# --- the experiment ---------------------------------------------------------------------------


def make_judge(spec: str, timeout: float, attempts: int, **load: Any) -> Any:
    """``api``: an :class:`HTTPJudge` from the environment; a model directory: a
    :class:`LocalJudge`."""
    if spec == "api":
        return HTTPJudge.from_env(timeout=timeout, attempts=attempts)
    from diffattn.eval.common import load_models

    return LocalJudge(load_models([spec], **load)[0])


def _accuracy(verdicts: Sequence[bool | None]) -> dict[str, Any]:
    parsed = [v for v in verdicts if v is not None]
    n = len(parsed)
    p = sum(parsed) / n if n else math.nan
    return {
        "accuracy": p,
        "stderr": math.sqrt(p * (1 - p) / n) if n else math.nan,
        "n": n,
        "unparsed": len(verdicts) - n,
    }


def run(
    models: Sequence[EvalModel],
    judge: Any,
    settings: HallucinationSettings | None = None,
    *,
    quiet: bool = True,
    **changes: Any,
) -> dict[str, Any]:
    """Judged hallucination-free accuracy of every model on the same samples (``settings``,
    or its fields by name: ``run(models, judge, data=["longbench"], samples=20)``)."""
    settings = HallucinationSettings.given(settings, changes)
    settings.check()
    if not settings.data:
        raise ValueError("--data: give at least one LongBench-format jsonl file")
    seed = settings.seed
    seed_everything(seed)
    datasets = load_samples(settings.data, settings.task, settings.samples, seed)
    results: dict[str, Any] = {
        "judge": judge.describe(),
        "datasets": {name: {"task": s[0].task, "samples": len(s)} for name, s in datasets.items()},
        "data_fingerprint": fingerprint(
            {name: [[x.id, x.context, x.question] for x in s] for name, s in datasets.items()}
        ),
        "models": {},
    }
    for model in models:
        per_dataset = {}
        for name, chosen in datasets.items():
            outputs = generate(
                model,
                chosen,
                settings.max_new_tokens,
                settings.max_input_tokens,
                settings.stop,
                settings.batch_size,
                quiet,
            )
            replies, verdicts = [], []
            for sample, output in progress(
                list(zip(chosen, outputs, strict=True)), len(chosen), f"judge {name}", quiet
            ):
                prompt = judge_prompt(
                    sample.context,
                    sample.question,
                    list(sample.answers),
                    output,
                    sample.task,
                    settings.judge_document_chars,
                )
                reply = judge.reply(prompt)
                replies.append(reply)
                verdicts.append(parse_verdict(reply))
            per_dataset[name] = {
                **_accuracy(verdicts),
                "items": [
                    {"id": s.id, "output": o, "judge_reply": r, "verdict": v}
                    for s, o, r, v in zip(chosen, outputs, replies, verdicts, strict=True)
                ],
            }
        accuracies = [d["accuracy"] for d in per_dataset.values()]
        results["models"][model.name] = {
            "datasets": per_dataset,
            "mean_accuracy": sum(accuracies) / len(accuracies),
        }
    return results


# --- outputs ----------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> Path:
    """Accuracy per dataset and model with standard-error bars (DIFF V1 Table 4)."""
    names, datasets = list(results["models"]), list(results["datasets"])
    width = 0.8 / len(names)
    fig, ax = one_axes(figsize=(1.5 + 1.3 * len(datasets) * max(len(names), 1) ** 0.5, 4))
    for k, name in enumerate(names):
        by = results["models"][name]["datasets"]
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(datasets))]
        ys = [by[d]["accuracy"] for d in datasets]
        errors = [0 if math.isnan(by[d]["stderr"]) else by[d]["stderr"] for d in datasets]
        ax.bar(xs, ys, width, yerr=errors, capsize=3, label=name)
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy (free of hallucination)")
    ax.set_title("Contextual hallucination (DIFF V1 Table 4)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, path)


def report(results: dict[str, Any]) -> str:
    datasets = list(results["datasets"])
    rows = []
    for name, r in results["models"].items():
        cells = []
        for d in datasets:
            x = r["datasets"][d]
            cells.append(
                f"{x['accuracy']:.3f} ± {x['stderr']:.3f} (n={x['n']}, {x['unparsed']} unparsed)"
            )
        rows.append((name, *cells, r["mean_accuracy"]))
    header = [f"{d} ({results['datasets'][d]['task']})" for d in datasets]
    judge = results["judge"]
    return (
        "## Contextual hallucination (DIFF V1 Table 4)\n\n"
        + markdown_table(["model", *header, "mean"], rows)
        + f"\nJudge: {json.dumps(judge)}. Accuracy = share of outputs judged accurate and free "
        "of hallucination (binary verdicts), ± standard error √(p(1−p)/n); unparsed verdicts "
        "are left out.\n"
    )


def main(args: Any) -> int:
    settings = HallucinationSettings.from_args(args)
    models = models_from_args(args)
    judge = make_judge(
        settings.judge,
        settings.judge_timeout,
        settings.judge_attempts,
        device=args.device,
        dtype=args.dtype,
    )
    results = run(models, judge, settings, quiet=args.quiet)
    figure = plot(results, Path(args.out) / "hallucination.png")
    return finish(
        args,
        NAME,
        results,
        models,
        report(results),
        {**settings.report(), "judge": judge.describe()},
        [figure],
    )
