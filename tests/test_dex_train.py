"""Dex trained through diffattn's trainer (Dex paper §3.3–3.4, App. F.1) and ``diffattn dex``.

A tiny random Hugging Face Llama (hidden 64, 2 layers, 4 heads, 2 key/value heads) whose
vocabulary is a tiny BPE trained on a fixture corpus, saved with the model directory.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from extras import require_extra

pytestmark = require_extra("hf")

from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from diffattn import dex
from diffattn.cli import main
from diffattn.dex.train import (
    DexTrainOptions,
    dex_factory,
    resolve_source,
    train_dex,
)
from diffattn.train import read_metrics
from diffattn.train.factory import FACTORY_STATE_NAME
from helpers import word_corpus

STEPS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dex_train")
    corpus, tokenizer = word_corpus(root, 300)
    model_dir = root / "llama"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save(model_dir)
    overrides = [
        f"data.sources=[{corpus}]",
        "data.document_split=paragraph",
        "data.valid_fraction=0.2",
        f"data.cache_dir={root / 'cache'}",
        "seq_len=32",
        "eval_batches=2",
        "device=cpu",
    ]
    return {"root": root, "model": model_dir, "overrides": overrides}


@pytest.fixture(scope="module")
def trained(tiny):
    out = tiny["root"] / "run"
    options = DexTrainOptions(
        model=str(tiny["model"]),
        out=str(out),
        heads="all",
        steps=STEPS,
        overrides=tiny["overrides"] + ["checkpoint_every=2", "keep_last=null"],
        progress=False,
    )
    return train_dex(options)


def test_trains_only_the_dex_set_and_advances_t(tiny, trained):
    base = AutoModelForCausalLM.from_pretrained(str(tiny["model"]), dtype=torch.float32)
    base_state = base.state_dict()
    model = trained.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in dex.named_trainable_parameters(model)}
    changed = 0
    for name, param in model.named_parameters():
        if name in base_state:
            same = torch.equal(param.detach(), base_state[name])
            if name in trainable:
                changed += not same
            else:
                assert same, f"frozen {name} changed"
    assert changed == len([n for n in trainable if n in base_state])  # every K/V/O moved
    for layer in dex.dex_layers(model).values():
        assert not torch.equal(layer.w_d.detach(), torch.eye(16).expand_as(layer.w_d))
    assert dex.get_step(model) == STEPS == trained.step
    state = load_file(str(trained.checkpoint / FACTORY_STATE_NAME))
    steps = [k for k in state if k.endswith("dex.step")]
    assert steps and all(int(state[k]) == STEPS for k in steps)
    records = read_metrics(trained.out)
    assert [r["step"] for r in records if "dex_lambda" in r] == list(range(1, STEPS + 1))
    assert len(trained.lambdas) == STEPS and len(trained.lambdas[0][1]) == 2
    assert trained.loss_before > 0 and trained.loss_after > 0
    assert (trained.adapter / "dex_config.json").is_file()


def test_resume_is_exact(tiny, trained):
    copy = tiny["root"] / "resumed"
    shutil.copytree(trained.out, copy)
    shutil.rmtree(copy / "checkpoints" / f"step-{STEPS:08d}")
    first = {r["step"]: r["loss"] for r in read_metrics(trained.out)}
    options = DexTrainOptions(
        model=str(tiny["model"]),
        out=str(copy),
        steps=STEPS,
        overrides=tiny["overrides"] + ["checkpoint_every=2", "keep_last=null"],
        resume=True,
        progress=False,
    )
    again = train_dex(options)
    second = {r["step"]: r["loss"] for r in read_metrics(copy)}
    for step in range(3, STEPS + 1):
        assert abs(first[step] - second[step]) <= 1e-6, step
    assert dex.get_step(again.model) == STEPS
    for (name, a), b in zip(
        trained.model.state_dict().items(), again.model.state_dict().values(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6), name


def test_merge_matches_trained_model(tiny, trained, tmp_path):
    out = tmp_path / "merged"
    assert main(["dex", "merge", str(trained.out), str(tiny["model"]), "--out", str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert not dex.is_dex(merged)
    # the trained Dex model rebuilt from its last checkpoint
    heads = dex.HeadSelection.load(trained.out / "heads.json")
    rebuilt = dex_factory(resolve_source(tiny["model"]), heads, STEPS // 2, "exp")()
    rebuilt.load_state_dict(load_file(str(trained.checkpoint / FACTORY_STATE_NAME)))
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = rebuilt.eval()(ids).logits
        got = merged(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(str(tiny["model"]))(ids).logits
    assert (want - got).abs().max() <= 1e-4
    assert (want - plain).abs().max() > 1e-3  # training changed the function
    assert (out / "tokenizer.json").is_file()


def test_select_cli(tiny, tmp_path, capsys):
    out = tmp_path / "heads.json"
    argv = ["dex", "select", str(tiny["model"]), "--method", "importance", "--k", "1"]
    assert main([*argv, "--out", str(out), "--quiet", *_sets(tiny)]) == 0
    saved = json.loads(out.read_text())
    assert saved["method"] == "importance" and saved["k"] == 1
    assert all(len(h) == 1 for h in saved["heads"].values())
    assert "total: 2 of 8 heads" in capsys.readouterr().out


def _sets(tiny):
    return [x for o in tiny["overrides"] for x in ("--set", o)]


def test_train_cli_prints_losses(tiny, tmp_path, capsys):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [1], "1": [0, 3]}))
    argv = ["dex", "train", str(tiny["model"]), "--out", str(tmp_path / "r"), "--steps", "2"]
    assert (
        main([*argv, "--heads", str(heads), "--lambda-init", "0.8", "--quiet", *_sets(tiny)]) == 0
    )
    text = capsys.readouterr().out
    assert "held-out loss: before" in text and "λ(t)" in text
    assert json.loads((tmp_path / "r" / "heads.json").read_text())["heads"] == {
        "0": [1],
        "1": [0, 3],
    }


def test_bad_heads_file_exits_2(tiny, tmp_path, capsys):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"5": [0]}))
    out = tmp_path / "r"
    argv = ["dex", "train", str(tiny["model"]), "--out", str(out), "--heads", str(heads)]
    assert main([*argv, "--quiet", *_sets(tiny)]) == 2
    err = capsys.readouterr().err
    assert "heads file" in err and "5" in err
    assert not out.exists()


def test_unsupported_model_exits_2(tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)).save_pretrained(gpt2)
    assert main(["dex", "train", str(gpt2), "--out", str(tmp_path / "r"), "--quiet"]) == 2
    assert "not supported by Dex" in capsys.readouterr().err
    assert main(["dex", "train", str(tmp_path / "nothing"), "--out", str(tmp_path / "r")]) == 2


def test_compare_end_to_end(tiny, tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["dex", "compare", str(tiny["model"]), "--out", str(out), "--steps", "2", "--quiet"]
    assert main(argv + _sets(tiny)) == 0
    report = json.loads((out / "report.json").read_text())
    assert [r["method"] for r in report["rows"]] == ["base", "dex", "lora8", "lora32", "ft"]
    assert all(r["status"] == "ok" and r["val_loss"] > 0 for r in report["rows"])
    trainable = {r["method"]: r["trainable_parameters"] for r in report["rows"]}
    assert trainable["lora8"] < trainable["lora32"] < trainable["ft"]
    assert (out / "loss_curves.png").stat().st_size > 1000
    md = (out / "report.md").read_text()
    assert md.count("\n| ") == 6  # header + 5 rows
    assert "LoRA r=32" in capsys.readouterr().out
