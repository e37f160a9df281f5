"""An attention type from another, installed package works where a built-in type does.

``tests/toy_attention_type`` is a package that declares the type ``tempered`` in one file and
registers it through the ``diffattn.attention_types`` entry point. It is installed once (``pip
install --no-deps --target``) and every flow below runs as a command in a fresh process whose
``sys.path`` holds it: nothing imports the package by hand, so each command finds the type
through the entry point, as a user's would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from extras import require_extra

pytestmark = [require_extra("train"), pytest.mark.slow]

import yaml

from train_helpers import tiny_recipe

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "tests" / "toy_attention_type"
OPTIONS = {"tempered": {"init_temperature": 1.5}}


def _env(target: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(REPO / "src"), str(REPO / "tests")])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _run(target: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv],
        env=_env(target),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=target.parent,
    )


def _torchrun(target: Path, *argv: str, timeout: float) -> subprocess.CompletedProcess:
    from helpers import free_port

    return _run(
        target,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "-m",
        "diffattn.train",
        *argv,
        timeout=timeout,
    )


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The toy package installed into a folder of its own (its entry points with it)."""
    target = tmp_path_factory.mktemp("toy-site")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(PACKAGE),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(target.glob("toy_attention_type-*.dist-info/entry_points.txt"))
    return target


@pytest.fixture(scope="module")
def recipe(installed, tmp_path_factory):
    """A tiny recipe of the toy type with one option set."""
    cache = tmp_path_factory.mktemp("toy-data")
    fields = tiny_recipe(cache, steps=4, checkpoint_every=2, keep_last=None)
    # a context of 160 tokens leaves room for eval needle's shortest prompt (73 tokens here)
    fields["model"].update(attention="tempered", attention_options=OPTIONS, max_seq_len=160)
    path = installed.parent / "tempered.yaml"
    path.write_text(yaml.safe_dump(fields), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(installed, recipe):
    """``diffattn train`` of the toy type: 4 steps, checkpoints at 2 and 4."""
    out = installed.parent / "run"
    _ok(_run(installed, "-m", "diffattn", "train", str(recipe), "--out", str(out), "--quiet"))
    return out


def _losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_the_entry_point_registers_the_type(installed):
    out = _ok(
        _run(
            installed,
            "-c",
            "from diffattn import attention_type; t = attention_type('tempered'); "
            "print(t.title, type(t).__module__)",
        )
    )
    assert out.strip() == "Tempered softmax toy_attention_type"


def test_training_saves_the_type_and_its_options_and_resumes_exactly(installed, recipe, trained):
    config = json.loads((trained / "checkpoints" / "final" / "config.json").read_text())
    assert config["attention"] == "tempered"
    assert config["attention_options"] == OPTIONS
    resumed = installed.parent / "resumed"
    train = ("-m", "diffattn", "train", str(recipe), "--out", str(resumed), "--quiet")
    _ok(_run(installed, *train, "--steps", "2"))
    _ok(_run(installed, *train, "--resume"))
    full, again = _losses(trained), _losses(resumed)
    assert sorted(again) == [1, 2, 3, 4]
    assert max(abs(full[s] - again[s]) for s in (3, 4)) <= 1e-6


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_distributed_training_runs_the_type(installed, recipe, parallel):
    out = installed.parent / f"run-{parallel}"
    overrides = ["--set", f"parallel={parallel}", "--set", "micro_batch_size=2"]
    done = _torchrun(
        installed,
        str(recipe),
        "--out",
        str(out),
        *overrides,
        "--steps",
        "2",
        "--quiet",
        timeout=400,
    )
    _ok(done)
    assert sorted(_losses(out)) == [1, 2]


def test_tensor_parallelism_is_refused_with_the_declared_reason(installed, recipe):
    out = installed.parent / "run-tp"
    done = _torchrun(
        installed,
        str(recipe),
        "--out",
        str(out),
        "--set",
        "tp=2",
        "--steps",
        "1",
        "--quiet",
        timeout=300,
    )
    assert done.returncode != 0
    assert "attention type 'tempered' declares no tensor-parallel plan" in done.stderr


def test_generation_runs_with_each_cache_and_the_caches_equal_the_full_forward(installed, trained):
    for cache in ("dynamic", "static"):
        out = _run(
            installed,
            "-m",
            "diffattn",
            "generate",
            str(trained),
            "--prompt",
            "def f",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
            "--cache",
            cache,
        )
        assert _ok(out).startswith("def f")
    # greedy tokens of a 4-step model sit on near-ties, so the caches are compared by logits
    script = f"""
import torch
from diffattn import load_model
from diffattn.cache import DynamicCache, StaticCache
model = load_model({str(trained)!r})
ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
full = model(ids).logits
for cache in (DynamicCache(), StaticCache(model.config, 2, 16)):
    steps = [model(ids[:, :5], past_key_values=cache).logits]
    steps += [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(5, 11)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
print(type(model.layers[0].attn).__name__)
"""
    assert _ok(_run(installed, "-c", script)).strip() == "TemperedAttention"


def test_hugging_face_auto_classes_save_and_load_the_type(installed, trained):
    script = f"""
import torch, diffattn
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(trained / "checkpoints" / "final")!r})
ids = torch.arange(1, 12).unsqueeze(0)
model.save_pretrained({str(installed.parent / "hf-saved")!r})
again = AutoModelForCausalLM.from_pretrained({str(installed.parent / "hf-saved")!r})
kind = type(again.model.layers[0].attn).__name__
assert kind == "TemperedAttention", kind
assert torch.equal(model(ids).logits, again(ids).logits)
print("ok")
"""
    assert _ok(_run(installed, "-c", script)).strip().endswith("ok")


def test_the_probe_captures_the_types_maps(installed, trained):
    out = installed.parent / "maps"
    _ok(
        _run(
            installed,
            "-m",
            "diffattn",
            "eval",
            "attention",
            str(trained),
            "--prompt",
            "def f ( x ) : return x",
            "--out",
            str(out),
        )
    )
    assert list(out.glob("*.png")) and list(out.glob("*.json"))


EVAL_ANALYSES = {
    "loss": ["--max-tokens", "600"],
    "outliers": ["--max-tokens", "600", "--bits", "16", "8", "4"],
    "needle": [
        "--needles",
        "1",
        "--digits",
        "1",
        "--lengths",
        "100",
        "--depths",
        "0",
        "100",
        "--samples",
        "1",
        "--max-new-tokens",
        "4",
    ],
    "heads": ["--seq-len", "24", "--max-tokens", "120"],
    "hessian": ["--seq-len", "24", "--batches", "2", "--iters", "3"],
}
"""Every analysis of ``diffattn eval`` that takes a trained model of any type (``effective``
needs a Dex adapter, ``mc``/``icl``/``hallucination`` data or a judge the tiny run cannot
answer), at sizes a 64-token, 2-layer model takes."""


@pytest.mark.parametrize("analysis", list(EVAL_ANALYSES))
def test_every_eval_analysis_measures_the_type(installed, trained, analysis):
    out = installed.parent / f"eval-{analysis}"
    argv = ["-m", "diffattn", "eval", analysis, str(trained), "--out", str(out), "--quiet"]
    _ok(_run(installed, *argv, *EVAL_ANALYSES[analysis]))
    record = json.loads((out / "results.json").read_text())
    assert record["experiment"] == analysis
    (entry,) = record["results"]["models"].values()
    assert entry, f"{analysis} measured nothing"
    text = json.dumps(entry)
    assert "NaN" not in text or analysis == "heads", text[:500]  # heads pads absent maps
    assert list(out.glob("*.png")) and (out / "report.md").is_file()


def test_the_hub_export_carries_the_type_where_neither_package_imports(installed, trained):
    hub, report = installed.parent / "hub", installed.parent / "hub-report.json"
    _ok(
        _run(
            installed,
            "-m",
            "diffattn",
            "convert",
            str(trained / "checkpoints" / "final"),
            str(hub),
            "--to",
            "hub",
        )
    )
    check = REPO / "tests" / "hub_remote_check.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(installed.parent / "hf-modules"), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [
            sys.executable,
            str(check),
            str(hub),
            str(report),
            "--block-diffattn",
            "--block",
            "toy_attention_type",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    _ok(done)
    seen = json.loads(report.read_text())
    assert seen["diffattn_modules"] == []
    script = f"""
import json, torch
from diffattn import load_model
seen = json.load(open({str(report)!r}))
model = load_model({str(trained / "checkpoints" / "final")!r})
ids = torch.tensor(seen["input_ids"][:1])
want = model(ids).logits[0]
for key in ("logits", "reloaded_logits"):
    torch.testing.assert_close(torch.tensor(seen[key]), want, rtol=0, atol=1e-5)
print("ok")
"""
    assert _ok(_run(installed, "-c", script)).strip() == "ok"


def test_bench_times_the_type_beside_the_baseline(installed):
    out = _ok(
        _run(
            installed,
            "-m",
            "diffattn",
            "bench",
            "--json",
            "--no-hf",
            "--models",
            "baseline,tempered",
            "--seq-len",
            "32",
            "--d-model",
            "128",
            "--layers",
            "1",
            "--batch",
            "1",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--mode",
            "fwd",
        )
    )
    rows = json.loads(out)
    assert {row["attention"] for row in rows} == {"baseline", "tempered"}


def test_the_vllm_layout_refuses_the_type_with_its_declared_reason(installed, trained):
    """What ``serve --engine vllm`` checks before any engine starts (vLLM is not installed
    here; tests/test_vllm_server.py runs the command where it is)."""
    script = f"""
from diffattn import load_model
from diffattn.vllm_plugin.layout import attention_layout
config = load_model({str(trained)!r}).config
try:
    attention_layout(config, 0, 1)
except ValueError as error:
    print(error)
"""
    assert _ok(_run(installed, "-c", script)).strip() == (
        "vLLM cannot serve attention type 'tempered': its per-head temperature is not part of "
        "vLLM's stock attention call"
    )


@pytest.mark.extra("serve")
def test_the_transformers_engine_serves_the_type(installed, trained, monkeypatch):
    from serve_helpers import ServerProcess

    monkeypatch.setenv("PYTHONPATH", str(installed))  # the server finds the entry point
    server = ServerProcess(trained, log=installed.parent / "serve.log")
    try:
        body = {"model": str(trained), "prompt": "def f", "max_tokens": 6, "temperature": 0}
        status, answer = server.request("POST", "/v1/completions", body, timeout=120)
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 6
        assert answer["choices"][0]["text"]
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.extra("eval")
def test_compare_and_scaling_take_the_type_and_its_option_as_arms(installed):
    """Spawned workers (``--jobs 2``) find the type through its entry point too."""
    from compare_helpers import tiny_overrides, write_corpus

    corpus = write_corpus(installed.parent / "corpus", 16)
    sets = [
        *tiny_overrides(corpus, installed.parent / "compare-cache"),
        "retrieval.steps=2", "retrieval.seeds=1", "retrieval.test_episodes=2",
        "retrieval.d_model=16", "retrieval.grid=[4]", "retrieval.bits=[8]",
    ]  # fmt: skip
    out = installed.parent / "compare"
    arms = "baseline,tempered,tempered:init_temperature=2"
    argv = ["-m", "diffattn", "compare", "--out", str(out), "--steps", "2", "--seeds", "1",
            "--jobs", "2", "--no-eval", "--attention", arms, "--quiet"]  # fmt: skip
    _ok(_run(installed, *argv, *[arg for s in sets for arg in ("--set", s)], timeout=600))
    rows = {r["attention"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert (
        rows["tempered:init_temperature=2.0"]["model"] == "Tempered softmax (init_temperature=2.0)"
    )
    assert rows["tempered"]["model"] == "Tempered softmax"
    report = (out / "report.md").read_text()
    assert "no paper claim" in report
    scaling = installed.parent / "scaling"
    fields = tiny_recipe(installed.parent / "scaling-cache", eval_every=2)
    fields["schedule"] = {"warmup_steps": 1, "total_steps": None}
    plain = installed.parent / "scaling.yaml"  # the arms set the type: no options of one here
    plain.write_text(yaml.safe_dump(fields), encoding="utf-8")
    argv = ["-m", "diffattn", "scaling", "--out", str(scaling), "--config", str(plain),
            "--sizes", "d_model=16,n_heads=2", "d_model=32,n_heads=4", "d_model=48,n_heads=6",
            "--attention", "baseline", "tempered", "--steps", "2", "--quiet"]  # fmt: skip
    _ok(_run(installed, *argv, timeout=900))
    assert "Tempered softmax" in (scaling / "report.md").read_text()
