"""``diffattn eval``'s settings (:mod:`diffattn.settings`): each experiment's report keeps
the settings block it always wrote (key order included), through the real command line on tiny
models; each setting is declared once (``run`` repeats no default, no option is written by
hand, the parsed defaults are the dataclass's); each bound keeps its message word for word."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Literal

import pytest

from diffattn.cli import main
from diffattn.settings import Settings, setting
from helpers import tiny_diffattn, tiny_hf

pytestmark = pytest.mark.extra("train", "hf")

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i}\n" * (i + 2) for i in range(4)]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A tiny DIFF V1 model, a tiny Llama with a Dex adapter, text, multiple-choice items and
    LongBench-format samples."""
    from transformers import PreTrainedTokenizerFast

    from diffattn import dex
    from diffattn.checkpoint import save_model
    from diffattn.data import train_bpe

    root = tmp_path_factory.mktemp("settings")
    tokenizer = train_bpe(TEXTS * 20, 300, cache_dir=root / "bpe")
    model = tiny_diffattn("diff_v1", vocab_size=tokenizer.vocab_size, max_seq_len=256)
    save_model(model, root / "model", tokenizer=tokenizer)
    llama = tiny_hf("llama", vocab_size=tokenizer.vocab_size)
    llama.save_pretrained(root / "base")
    tokenizer.save(root / "tok")
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(root / "tok" / "tokenizer.json"))
    hf_tokenizer.save_pretrained(root / "base")
    dex.apply(llama, heads={0: [1]}, anneal_steps=0, lambda_learn_init=0.5)
    dex.save_adapter(llama, root / "adapter")
    (root / "data.txt").write_text("".join(TEXTS))
    items = [
        {"query": "2 + 2 =", "choices": ["4", "5"], "gold": 0, "id": "a"},
        {"query": "3 + 3 =", "choices": ["6", "7"], "gold": 0, "id": "b"},
    ]
    (root / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    samples = [
        {"input": f"What is {i}?", "context": f"It is {i}. " * 5, "answers": [str(i)]}
        for i in range(2)
    ]
    (root / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    return root


TEXT = "--data ROOT/data.txt --split all --seq-len 16 --max-tokens 64"
RUNS = {
    "loss": f"ROOT/model {TEXT}",
    "needle": "ROOT/model --needles 2 --lengths 200 --depths 50 --samples 1 --max-new-tokens 2",
    "outliers": f"ROOT/model {TEXT} --bits 16 4",
    "heads": f"ROOT/model {TEXT}",
    "effective": f"ROOT/base --dex ROOT/adapter {TEXT} --windows 1 --steps 2",
    "hessian": f"ROOT/model {TEXT} --batches 1 --iters 2",
    "mc": "ROOT/model --data ROOT/mine.jsonl",
    "icl": "ROOT/model --classes 3 --shots 0 1 --test-items 2 --budget 200",
    "hallucination": "ROOT/model --data ROOT/hotpotqa.jsonl --judge ROOT/model --samples 1 "
    "--max-new-tokens 2",
    "attention": "ROOT/model --prompt 'def add(a, b):' --layers 0",
}
"""A tiny run of each experiment (ROOT: the zoo)."""

DATA = {
    "data": ["ROOT/data.txt"],
    "split": "all",
    "valid_fraction": 0.02,
    "data_seed": 0,
    "seq_len": 16,
    "max_tokens": 64,
}
"""The document settings of the runs of TEXT."""
SETTINGS = {
    "attention": {
        "prompt": "def add(a, b):",
        "token_ids": None,
        "layers": [0],
        "heads": None,
        "queries": [-1],
        "view": "row",
        "special_tokens": True,
        "max_labels": 48,
    },
    "effective": {
        **DATA,
        "windows": 1,
        "max_heads": 8,
        "steps": 2,
        "lr": 0.001,
        "optimizer": "adam",
        "seed": 0,
    },
    "hallucination": {
        "data": ["ROOT/hotpotqa.jsonl"],
        "task": "auto",
        "samples": 1,
        "max_new_tokens": 2,
        "max_input_tokens": None,
        "stop": "\n\n",
        "judge_document_chars": 8000,
        "batch_size": 8,
        "seed": 0,
        "judge": {"kind": "local", "model": "ROOT/model"},
    },
    "heads": {
        **DATA,
        "batch_size": 8,
        "seed": 0,
        "layer": 1,
    },
    "hessian": {
        **DATA,
        "batches": 1,
        "iters": 2,
        "tol": 0.001,
        "params": "all",
        "batch_size": 8,
        "seed": 0,
    },
    "icl": {
        "dataset": "synthetic",
        "data": None,
        "classes": 3,
        "shots": ["0", "1"],
        "budget": 200,
        "test_items": 2,
        "arrangements": ["random"],
        "permutations": 1,
        "decoding": "greedy",
        "use_cache": True,
        "batch_size": 8,
        "seed": 0,
    },
    "loss": {
        **DATA,
        "ngram": 2,
        "exclude_frequent": 0,
        "train_data": None,
        "batch_size": 8,
        "seed": 0,
    },
    "mc": {
        "tasks": None,
        "data": ["ROOT/mine.jsonl"],
        "split": "validation",
        "source": "auto",
        "shots": 0,
        "limit": None,
        "batch_size": 8,
        "seed": 0,
    },
    "needle": {
        "needles": 2,
        "queries": 1,
        "lengths": [200],
        "depths": [50.0],
        "samples": 1,
        "haystack": "synthetic",
        "seed": 0,
        "batch_size": 8,
        "max_new_tokens": 2,
        "attention": True,
        "digits": 7,
    },
    "outliers": {
        **DATA,
        "bits": [16, 4],
        "batch_size": 8,
        "seed": 0,
    },
}
"""Each experiment's settings block in ``results.json``, as the command wrote it before the
settings were declared once (key order included)."""


def test_every_experiment_is_run_here():
    assert sorted(RUNS) == sorted(m.NAME for m in _experiments())


@pytest.mark.parametrize("experiment", sorted(RUNS))
def test_the_settings_block_is_unchanged(zoo, tmp_path, experiment, one_thread):
    out = tmp_path / "out"
    argv = shlex.split(RUNS[experiment].replace("ROOT", str(zoo)))
    assert main(["eval", experiment, *argv, "--out", str(out), "--quiet"]) == 0
    record = json.loads((out / "results.json").read_text())
    written = json.loads(json.dumps(record["settings"]).replace(str(zoo), "ROOT"))
    assert list(written.items()) == list(SETTINGS[experiment].items())  # in the same order
    header = (out / "report.md").read_text().split("\n")[3]
    block = json.dumps(SETTINGS[experiment], sort_keys=True).replace("ROOT", str(zoo))
    assert header.endswith(f"settings `{block}`")


# ------------------------------------------------------------------------------------------------
# each setting declared once
# ------------------------------------------------------------------------------------------------
REQUIRED = {"attention": ["--prompt", "x"], "hallucination": ["--data", "d.jsonl"]}
"""What a bare command line of each experiment needs besides MODEL."""
CLI_DEFAULTS = {("hessian", "batch_size"): 8}
"""Settings whose command-line default differs from their default in Python, on purpose (the
Hessian's batches hold 4 windows from Python, as every experiment's ``--batch-size`` 8)."""


def _experiments():
    from diffattn.commands.eval import experiments

    return experiments()


def _settings_class(module):
    from diffattn.settings import Settings

    cls = getattr(module.add_arguments, "__self__", None)
    assert isinstance(cls, type) and issubclass(cls, Settings), (
        f"{module.__name__}.add_arguments is not generated from a settings dataclass"
    )
    return cls


@pytest.mark.parametrize("module", _experiments(), ids=lambda m: m.NAME)
def test_run_takes_the_settings_and_declares_no_default_of_its_own(module):
    import dataclasses
    import inspect

    names = {f.name for f in dataclasses.fields(_settings_class(module))}
    for parameter in inspect.signature(module.run).parameters.values():
        if parameter.default is not inspect.Parameter.empty:
            assert parameter.name not in names, f"{module.NAME}.run declares {parameter.name}"


@pytest.mark.parametrize("module", _experiments(), ids=lambda m: m.NAME)
def test_no_option_is_written_by_hand(module):
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    settings_classes = {
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == _settings_class(module).__name__
    }
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in settings_classes:
            continue
        for call in ast.walk(node):
            if not isinstance(call, ast.Call):
                continue
            name = getattr(call.func, "attr", getattr(call.func, "id", ""))
            assert name not in ("add_argument", "set_defaults"), (module.NAME, ast.unparse(call))
            keywords = [k.arg for k in call.keywords]
            assert "default" not in keywords, (module.NAME, ast.unparse(call))


@pytest.mark.parametrize("module", _experiments(), ids=lambda m: m.NAME)
def test_the_parsed_defaults_are_the_dataclass_defaults(module):
    import argparse
    import dataclasses

    from diffattn.eval.common import add_common_arguments

    cls = _settings_class(module)
    parser = argparse.ArgumentParser()
    add_common_arguments(parser)
    module.add_arguments(parser)
    args = parser.parse_args(["MODEL", *REQUIRED.get(module.NAME, [])])
    for key, value in (getattr(args, "data_defaults", None) or {}).items():
        setattr(args, key, value)  # what diffattn eval does for a model without a recipe
    parsed, default = dataclasses.asdict(cls.from_args(args)), dataclasses.asdict(cls())
    given = {flag.lstrip("-").replace("-", "_") for flag in REQUIRED.get(module.NAME, [])}
    for name, value in parsed.items():
        if name in given:
            continue
        expected = CLI_DEFAULTS.get((module.NAME, name), default[name])
        as_list = [list(v) if isinstance(v, tuple) else v for v in (value, expected)]
        assert as_list[0] == as_list[1], f"{module.NAME}: {name}"


def test_run_by_name_refuses_a_misspelt_setting():
    from diffattn.eval import effective

    with pytest.raises(TypeError, match="run\\(\\) got an unexpected keyword argument 'windw'"):
        effective.run([], windw=3)
    with pytest.raises(TypeError, match="takes EffectiveSettings"):
        effective.run([], {"windows": 3})


COUNTS = "--test-items, --permutations and --batch-size must be at least 1"
JUDGED = "--samples, --max-new-tokens and --batch-size must be at least 1"
PER_SAMPLE = "--samples, --batch-size and --max-new-tokens must be at least 1"
WINDOWS = "--seq-len and --max-tokens must be at least 2, --batch-size at least 1"
MESSAGES = [
    ("effective", {"windows": 0}, "--windows, --max-heads and --steps must be at least 1"),
    ("effective", {"steps": 0}, "--windows, --max-heads and --steps must be at least 1"),
    ("effective", {"seq_len": 1}, WINDOWS),
    ("effective", {"max_tokens": 1}, WINDOWS),
    ("loss", {"seq_len": 1}, WINDOWS),
    ("loss", {"batch_size": 0}, WINDOWS),
    ("heads", {"batch_size": 0}, WINDOWS),
    ("hessian", {"batches": 0}, "--batches must be at least 1, got 0"),
    ("hessian", {"params": "mlp"}, "--params must be one of ('all', 'attention'), got 'mlp'"),
    ("hessian", {"batch_size": 0}, WINDOWS),
    ("needle", {"queries": 0}, "--needles and --queries must be at least 1"),
    ("needle", {"needles": 66}, "--needles 66 exceeds the 65 built-in cities"),
    ("needle", {"lengths": (0,)}, "--lengths must be positive token counts, got [0]"),
    ("needle", {"lengths": ()}, "--lengths must be positive token counts, got []"),
    (
        "needle",
        {"depths": (50.0, 120.0)},
        "--depths must be percentages in 0…100, got [50.0, 120.0]",
    ),
    ("needle", {"max_new_tokens": 0}, PER_SAMPLE),
    ("needle", {"batch_size": 0}, PER_SAMPLE),
    ("needle", {"digits": 13}, "--digits must be in 1..12, got 13"),
    ("mc", {"shots": -1}, "--shots must be at least 0, got -1"),
    ("mc", {"limit": 0}, "--limit must be at least 1, got 0"),
    ("mc", {"batch_size": 0}, "--batch-size must be at least 1, got 0"),
    ("icl", {"permutations": 0}, COUNTS),
    ("icl", {"batch_size": 0}, COUNTS),
    ("icl", {"budget": 1}, "--budget must be at least 2 tokens, got 1"),
    ("icl", {"decoding": "beam"}, "--decoding must be one of greedy, scored, got 'beam'"),
    ("icl", {"arrangements": ("sorted",)}, "--arrangements must be among random, alternating"),
    ("icl", {"arrangements": ()}, "--arrangements must be among random, alternating"),
    ("hallucination", {"samples": 0}, JUDGED),
    ("hallucination", {"max_new_tokens": 0}, JUDGED),
    ("hallucination", {"batch_size": 0}, JUDGED),
    ("attention", {"max_labels": 0}, "--max-labels must be at least 1, got 0"),
    ("attention", {"view": "grid"}, "--view must be one of row, heatmap, both, got 'grid'"),
]
"""Each bound's message, word for word as the experiments have always worded it."""


@pytest.mark.parametrize(("experiment", "changes", "message"), MESSAGES)
def test_each_bound_has_its_message(experiment, changes, message):
    from diffattn.commands.eval import experiments

    (module,) = [m for m in experiments() if experiment == m.NAME]
    settings = _settings_class(module)(**changes)
    with pytest.raises(ValueError) as error:
        settings.check()
    assert str(error.value) == message


@pytest.mark.parametrize("name", ["common", "text"])
def test_the_shared_options_are_generated_too(name):
    import ast
    import importlib
    import inspect

    tree = ast.parse(inspect.getsource(importlib.import_module(f"diffattn.eval.{name}")))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert not [ast.unparse(c) for c in calls if getattr(c.func, "attr", "") == "add_argument"]


@dataclass(frozen=True)
class Toy(Settings):
    max_heads: int = setting(8, min=1, max=64, help="heads (default {default})")
    mode: Literal["a", "b"] = setting("a", error="--mode must be a or b, got {mode!r}")
    sizes: tuple[int, ...] = setting((1, 2), help="sizes (default {default})")
    verbose: bool = setting(False, command_only=True)
    first: str = setting("x", report_last=True)
    last: str = setting("y")


"""A settings class of every kind of setting."""


def test_the_mechanism_on_a_settings_class_of_its_own():
    import argparse

    parser = argparse.ArgumentParser()
    Toy.add_arguments(parser)
    options = {a.dest: a for a in parser._actions}
    assert options["max_heads"].option_strings == ["--max-heads"]
    assert options["max_heads"].help == "heads (default 8)"
    assert options["mode"].choices == ("a", "b")
    assert options["sizes"].nargs == "+" and options["sizes"].default == [1, 2]
    assert options["sizes"].help == "sizes (default 1 2)"
    parsed = Toy.from_args(parser.parse_args(["--max-heads", "3", "--sizes", "4"]))
    assert parsed == Toy(max_heads=3, sizes=[4])
    assert list(parsed.report()) == ["max_heads", "mode", "sizes", "last", "first"]
    for changes, message in [
        ({"max_heads": 0}, "--max-heads must be at least 1, got 0"),
        ({"max_heads": 65}, "--max-heads must be at most 64, got 65"),
        ({"mode": "c"}, "--mode must be a or b, got 'c'"),
    ]:
        with pytest.raises(ValueError) as error:
            Toy(**changes).check()
        assert str(error.value) == message
    assert Toy.given(Toy(max_heads=2), {"mode": "b"}) == Toy(max_heads=2, mode="b")
    with pytest.raises(TypeError, match="unexpected keyword argument 'verbose'"):
        Toy.given(None, {"verbose": True})  # the command's own option, no setting of run


def test_takes_settings_writes_the_run_of_an_experiment():
    import inspect

    from diffattn.settings import takes_settings

    seen = []

    @takes_settings(Toy)
    def run(models: list, settings: Toy, quiet: bool) -> dict:
        """The toy's body."""
        seen.append((models, settings, quiet))
        return {"max_heads": settings.max_heads}

    assert run(["m"], max_heads=3) == {"max_heads": 3}
    assert seen[-1] == (["m"], Toy(max_heads=3), True)
    run([], Toy(mode="b"), quiet=False, max_heads=2)
    assert seen[-1] == ([], Toy(max_heads=2, mode="b"), False)
    with pytest.raises(ValueError, match="--max-heads must be at most 64, got 65"):
        run([], max_heads=65)  # checked before the body runs
    with pytest.raises(TypeError, match="run\\(\\) got an unexpected keyword argument 'verbose'"):
        run([], verbose=True)
    with pytest.raises(TypeError, match="takes Toy, got dict"):
        run([], {"max_heads": 2})
    assert len(seen) == 2
    parameters = inspect.signature(run).parameters
    assert list(parameters) == ["models", "settings", "quiet", "changes"]
    assert parameters["settings"].default is None
    assert parameters["quiet"].kind is inspect.Parameter.KEYWORD_ONLY
    assert parameters["quiet"].default is True
    assert parameters["changes"].kind is inspect.Parameter.VAR_KEYWORD
    assert run.__doc__ == "The toy's body." and run.__name__ == "run"
    assert run.body(["x"], Toy(), False) == {"max_heads": 8}  # the body, unchecked


def test_a_nested_setting_takes_the_options_of_its_settings_class_in_its_place():
    import argparse

    from diffattn.settings import nested

    @dataclass(frozen=True)
    class Outer(Settings):
        before: int = setting(1)
        toy: dict = nested(Toy, lambda toy: {"heads": toy.max_heads}, default=dict)  # noqa: RUF009
        after: str = setting("z")

    parser = argparse.ArgumentParser()
    Outer.add_arguments(parser)
    dests = [a.dest for a in parser._actions if a.dest != "help"]
    assert dests == ["before", "max_heads", "mode", "sizes", "verbose", "first", "last", "after"]
    parsed = Outer.from_args(parser.parse_args(["--max-heads", "5", "--after", "y"]))
    assert parsed == Outer(before=1, toy={"heads": 5}, after="y")
    assert Outer().toy == {} and Outer().toy is not Outer().toy  # a fresh default each time
    Outer(toy={"heads": 70}).check()  # the built value is not checked against Toy's bounds
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-heads", "x"])  # argparse's own error, as in Toy
