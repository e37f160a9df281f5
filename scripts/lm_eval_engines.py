"""Samples per second of ``diffattn lm-eval --engine hf`` against ``--engine vllm``.

Builds one tiny model per attention type (random weights, 8 heads of width 32 over 4 KV heads,
the ASCII byte-level BPE of ``tests/test_lm_eval_vllm.py``, saved under ``--out``) and
``--limit`` ARC-style rows of random words, with the three task YAMLs of that test over them:
multiple choice (``loglikelihood``), greedy generation (``generate_until``, at most 12 tokens)
and ``loglikelihood_rolling``. Per type it builds each engine's harness model once, as
``diffattn lm-eval`` builds it (the harness's HF model over diffattn's loading; the harness's
vLLM model with the model arguments ``diffattn.eval.harness_vllm.check_model_args`` completes),
warms both up, then runs ``lm_eval.simple_evaluate`` on every row of each task, ``--rounds``
times, reversing the order of the engines every other round. Three settings: ``hf`` and
``vllm`` at ``--batch-size``, and ``vllm auto`` (the same engine, every request of a task
handed to vLLM at once). Reported per type, task and setting: samples (documents) per second
of the whole ``simple_evaluate`` (building the task's requests and its metrics included) and of
the seconds spent in the model's request methods (``loglikelihood``, ``generate_until``,
``loglikelihood_rolling``), each the median over rounds with its ratio to ``hf`` in the same
round (median); and the seconds each engine took to build (vLLM: the engine's start, which a
command pays once per run).

Run it with the interpreter of a venv where vLLM and the lm-eval extra are installed beside
diffattn (both engines run there)::

    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=src /path/to/vllm-venv/bin/python \\
        scripts/lm_eval_engines.py --limit 100 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_lm_eval_vllm import TASKS, ascii_bpe  # noqa: E402  (the tests' task YAMLs)

TYPES = ("baseline", "diff_v1", "diff_v2")
WORDS = [
    *("red", "blue", "green", "stone", "river", "cloud", "paper", "glass", "iron", "water"),
    *("light", "sound", "heat", "cold", "north", "south", "planet", "moon", "star", "tree"),
    *("leaf", "seed", "bird", "fish", "salt", "sugar", "copper", "silver", "wind", "rain"),
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=100, help="rows per task (default: 100)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    parser.add_argument("--batch-size", default="16", help="both engines' (default: 16)")
    parser.add_argument("--d-model", type=int, default=256, help="default: 256")
    parser.add_argument("--layers", type=int, default=4, help="default: 4")
    parser.add_argument("--out", default=None, help="models and tasks (default: a temp dir)")
    return parser.parse_args(argv)


def write_tasks(root: Path, rows: int) -> Path:
    """``rows`` ARC-style rows of random words (a question, four choices, an answer) and the
    task YAMLs of ``tests/test_lm_eval_vllm.py`` over them."""
    rng = random.Random(0)
    tasks = root / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    data = tasks / "rows.jsonl"
    with data.open("w", encoding="utf-8") as file:
        for index in range(rows):
            question = " ".join(rng.choices(WORDS, k=rng.randint(4, 24)))
            texts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 4))) for _ in range(4)]
            choices = {"text": texts, "label": list("ABCD")}
            row = {"id": index, "question": question, "choices": choices, "answerKey": "A"}
            file.write(json.dumps(row) + "\n")
    for name, yaml in TASKS.items():
        (tasks / f"{name}.yaml").write_text(yaml.format(data=data))
    return tasks


def build_models(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    """One random model per type of ``args.types`` (8 heads of width 32, 4 KV heads), sharing
    the tests' ASCII byte-level BPE (trained on their rows)."""
    import torch

    from diffattn import DiffTransformerLM, ModelConfig
    from diffattn.checkpoint import save_model

    tokenizer = ascii_bpe("<|endoftext|>")
    models = {}
    for seed, kind in enumerate(args.types):
        torch.manual_seed(seed)
        config = ModelConfig(
            vocab_size=len(tokenizer),
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=8,
            n_kv_heads=4,
            head_dim=32,
            max_seq_len=512,
            attention=kind,
            init_std=0.1,
        )
        model = DiffTransformerLM(config).eval()
        models[kind] = save_model(model, root / kind, tokenizer=tokenizer)
    return models


def build_engines(directory: Path, batch_size: str) -> tuple[dict, dict[str, float]]:
    """The settings (``name: (harness model, batch size to set or None)``) of ``directory``'s
    two harness models, built as ``diffattn lm-eval`` builds them, and the seconds each model
    took."""
    from diffattn.eval import harness, harness_vllm

    seconds = {}
    start = time.perf_counter()
    hf = harness.DiffattnLM(pretrained=str(directory), batch_size=batch_size, device="cpu")
    seconds["hf"] = time.perf_counter() - start
    start = time.perf_counter()
    vllm_class = harness_vllm.harness_vllm_model()
    model_args = harness_vllm.check_model_args({"pretrained": str(directory)}, vllm_class)
    vllm = vllm_class(**model_args, batch_size=batch_size)
    seconds["vllm"] = seconds["vllm auto"] = time.perf_counter() - start
    settings = {"hf": (hf, None), "vllm": (vllm, int(batch_size)), "vllm auto": (vllm, "auto")}
    return settings, seconds


REQUEST_METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def evaluate(setting: tuple, task: str, manager, limit: int) -> tuple[float, float]:
    """Seconds ``simple_evaluate`` takes on the first ``limit`` rows of ``task``, and the
    seconds of it spent in the model's request methods (``loglikelihood``, ...)."""
    import lm_eval

    model, batch_size = setting
    if batch_size is not None:  # the vLLM model, run at two batch sizes
        model.batch_size = batch_size
    in_model = [0.0]

    def timed(method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                in_model[0] += time.perf_counter() - start

        return call

    for name in REQUEST_METHODS:
        setattr(model, name, timed(getattr(type(model), name).__get__(model)))
    start = time.perf_counter()
    lm_eval.simple_evaluate(
        model=model, tasks=[task], task_manager=manager, limit=limit, verbosity="ERROR"
    )
    return time.perf_counter() - start, in_model[0]


def measure(models, tasks: Path, args: argparse.Namespace) -> list[dict]:
    """Interleaved rounds per type; one row per type, task and setting."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks))
    rows = []
    for kind, directory in models.items():
        settings, build_seconds = build_engines(directory, args.batch_size)
        for task in TASKS:  # warm-up: first calls pay for allocations and caches
            for setting in settings.values():
                evaluate(setting, task, manager, 4)
        times: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for round_index in range(args.rounds):
            order = list(settings) if round_index % 2 == 0 else list(settings)[::-1]
            for task in TASKS:
                for name in order:
                    measured = evaluate(settings[name], task, manager, args.limit)
                    times.setdefault((task, name), []).append(measured)
        rows += [
            summary(kind, task, name, times, build_seconds[name], args.limit)
            for task in TASKS
            for name in settings
        ]
        settings["vllm"][0].model.llm_engine.engine_core.shutdown()
    return rows


def summary(kind, task, name, times, build_seconds, limit) -> dict:
    """One row of the table: medians over the rounds; ratios to ``hf`` of the same round."""
    mine, hf = times[(task, name)], times[(task, "hf")]
    return {
        "type": kind,
        "task": task,
        "setting": name,
        "samples_per_s": limit / statistics.median(t for t, _ in mine),
        "ratio": statistics.median(h / m for (h, _), (m, _) in zip(hf, mine, strict=True)),
        "model_samples_per_s": limit / statistics.median(m for _, m in mine),
        "model_ratio": statistics.median(h / m for (_, h), (_, m) in zip(hf, mine, strict=True)),
        "build_s": build_seconds,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    root = Path(args.out or tempfile.mkdtemp(prefix="lm_eval_engines_"))
    tasks = write_tasks(root, args.limit)
    models = build_models(root, args)
    rows = measure(models, tasks, args)
    print(f"load average: {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print(
        "| type | task | setting | samples/s | vs hf | samples/s in the model | vs hf "
        "| model build (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['type']} | {row['task']} | {row['setting']} | {row['samples_per_s']:.1f} "
            f"| {row['ratio']:.2f} | {row['model_samples_per_s']:.1f} | {row['model_ratio']:.2f} "
            f"| {row['build_s']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
