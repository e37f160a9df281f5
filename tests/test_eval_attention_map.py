"""``diffattn eval attention``: the maps it draws and writes equal the probe's (and, for Hugging
Face models, transformers' own eager attention), A1 − λA2 recomputed from A1, A2 and λ, the
figures and JSON of the command, long-prompt labels, and one-line errors that leave --out alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from tests.helpers import tiny_diffattn, tiny_hf
from tests.test_eval_outliers import _save_diffattn, _save_hf, corpus  # noqa: F401

from diffattn.eval import attention_map as am
from diffattn.probe import AttentionMaps, Lambda, Probe

IDS = [5, 17, 3, 99, 42, 7, 7, 64, 11, 125, 3, 18, 5]  # 13 tokens


def _probe_maps(model, ids, layers=None):
    maps, lam = AttentionMaps(what=("probs", "applied", "lam"), layers=layers), Lambda()
    with torch.no_grad(), Probe(model, [maps, lam]):
        model(input_ids=torch.tensor([ids]))
    return maps.result(), lam.result()


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_maps_equal_the_probe_and_a1_minus_lambda_a2(attention):
    model = tiny_diffattn(attention)
    got = am.capture_maps(model, IDS, queries=None)
    reference, lam = _probe_maps(model, IDS)
    assert sorted(got) == [0, 1]
    for layer, maps in got.items():
        call = reference[layer][0]
        assert maps.queries == list(range(len(IDS))) and maps.kind == (
            "softmax" if attention == "baseline" else attention
        )
        if attention == "baseline":
            assert set(maps.maps) == {"a"} and maps.lam is None
            assert torch.equal(maps.maps["a"], call["probs.a"][0])
            continue
        assert set(maps.maps) == {"a1", "a2", "applied"}
        assert torch.equal(maps.maps["a1"], call["probs.a1"][0])
        assert torch.equal(maps.maps["a2"], call["probs.a2"][0])
        assert torch.equal(maps.maps["applied"], call["applied"][0])
        if attention == "diff_v1":  # λ of Eq.2, one scalar per layer
            assert maps.lam.dim() == 0
            assert float(maps.lam) == pytest.approx(lam["lambda"][layer], abs=1e-7)
            scale = maps.lam
        else:  # V2: one λ per head and token; their mean is the Lambda capture's
            assert maps.lam.shape == (maps.maps["a1"].shape[0], len(IDS))
            assert float(maps.lam.double().mean()) == pytest.approx(
                lam["lambda_mean"][layer], abs=1e-6
            )
            scale = maps.lam[..., None]
        recomputed = maps.maps["a1"] - scale * maps.maps["a2"]
        torch.testing.assert_close(maps.maps["applied"], recomputed, rtol=0, atol=1e-7)
        # softmax rows sum to one over the causal keys; nothing above the diagonal
        ones = torch.ones(maps.maps["a1"].shape[:2])
        torch.testing.assert_close(maps.maps["a1"].sum(-1), ones, rtol=0, atol=1e-6)
        upper = torch.ones(len(IDS), len(IDS), dtype=torch.bool).triu(1)
        assert bool((maps.maps["a2"][:, upper] == 0).all())


def test_selection_of_layers_heads_and_query_rows():
    model = tiny_diffattn("diff_v1")
    full = am.capture_maps(model, IDS, queries=None)
    got = am.capture_maps(model, IDS, layers=[1], heads=[1], queries=[-1, 4, -1])
    assert list(got) == [1]
    maps = got[1]
    assert maps.heads == [1] and maps.queries == [4, len(IDS) - 1]
    for name in ("a1", "a2", "applied"):
        assert maps.maps[name].shape == (1, 2, len(IDS))
        # layer 0 is not watched here, so it runs its own backend: equal up to rounding
        want = full[1].maps[name][1, [4, len(IDS) - 1]]
        torch.testing.assert_close(maps.maps[name][0], want, rtol=1e-5, atol=1e-6)


def test_hf_llama_maps_equal_transformers_eager_attention():
    model = tiny_hf("llama")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([IDS]), output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    got = am.capture_maps(model, IDS, heads=[0, 3], queries=None)
    for layer, maps in got.items():
        assert maps.kind == "softmax" and set(maps.maps) == {"a"} and maps.lam is None
        torch.testing.assert_close(
            maps.maps["a"], reference[layer][0, [0, 3]], rtol=1e-5, atol=1e-6
        )


def test_hf_diffllama_maps_equal_transformers_and_a1_minus_lambda_a2():
    model = tiny_hf("diffllama")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([IDS]), output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    got = am.capture_maps(model, IDS, queries=[-1])
    _, lam = _probe_maps(model, IDS)
    for layer, maps in got.items():
        assert maps.kind == "diffllama" and maps.heads == [0, 1]
        full = reference[layer][0, :, -1:]  # heads h and h + 2 are paired
        torch.testing.assert_close(maps.maps["a1"], full[:2], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(maps.maps["a2"], full[2:], rtol=1e-5, atol=1e-6)
        assert float(maps.lam) == pytest.approx(lam["lambda"][layer], abs=1e-7)
        want = full[:2] - float(lam["lambda"][layer]) * full[2:]
        torch.testing.assert_close(maps.maps["applied"], want, rtol=1e-5, atol=1e-6)


def test_dex_wrapped_model_shows_the_maps_of_its_base():
    """Dex changes head outputs (O' = O − λ f_D(O)), not maps: the first layer's picture of a
    Dex-wrapped Llama is its base model's, while later layers (which read the changed outputs)
    and the logits differ."""
    from diffattn import dex

    base = tiny_hf("llama")
    before = am.capture_maps(base, IDS, queries=None)
    with torch.no_grad():
        logits = base(input_ids=torch.tensor([IDS])).logits
    dex.apply(base, heads={0: [1], 1: [0, 3]}, anneal_steps=0, lambda_learn_init=0.5)
    after = am.capture_maps(base, IDS, queries=None)
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=torch.tensor([IDS])).logits, logits)
    assert torch.equal(after[0].maps["a"], before[0].maps["a"])
    assert not torch.allclose(after[1].maps["a"], before[1].maps["a"])


def test_bad_selection_is_named():
    model = tiny_diffattn("diff_v1")
    with pytest.raises(ValueError, match=r"--layers \[2\]: the model has 2 layers \(0-1\)"):
        am.capture_maps(model, IDS, layers=[2])
    with pytest.raises(ValueError, match=r"--heads \[5\]: layer 0 has 2 heads"):
        am.capture_maps(model, IDS, heads=[5])
    with pytest.raises(ValueError, match=r"--query \[13\]: the prompt has 13 tokens"):
        am.capture_maps(model, IDS, queries=[13])
    with pytest.raises(ValueError, match="the prompt has no tokens"):
        am.capture_maps(model, [])
    with pytest.raises(ValueError, match=r"token ids \[128\] are outside the model's vocab"):
        am.capture_maps(model, [1, 128])
    with pytest.raises(ValueError, match="--layers: expected comma-separated integers"):
        am.parse_indices("0,x", "--layers")
    assert am.parse_indices("all", "--heads") is None
    assert am.parse_indices("3, -1", "--query") == [3, -1]


def test_long_prompts_label_every_kth_token_and_the_query(tmp_path):
    ticks, stride = am.label_ticks(100, 48, always=[98])
    assert stride == 3 and ticks[:3] == [0, 3, 6] and ticks[-2:] == [98, 99] and len(ticks) == 35
    assert am.label_ticks(48, 48) == (list(range(48)), 1)
    model = tiny_diffattn("diff_v2", max_seq_len=256)
    ids = [(7 * i) % 120 + 1 for i in range(150)]
    maps = am.capture_maps(model, ids, layers=[0], heads=[0], queries=None)[0]
    labels = am.token_labels(None, ids)
    assert labels[:2] == ["#1", "#8"]
    row = am.plot_rows(maps, labels, 149, tmp_path / "row.png", max_labels=20)
    heat = am.plot_heatmap(maps, labels, tmp_path / "heat.png", max_labels=20)
    for path in (row, heat):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size < 400_000


def test_token_labels_are_printable(corpus):  # noqa: F811
    from diffattn.loading import TextTokenizer

    _, tok = corpus
    tokenizer = TextTokenizer(tok.backend)
    ids = tokenizer.encode("def f(x):\n    return x")
    labels = am.token_labels(tokenizer, ids, width=6)
    assert all("\n" not in label and 0 < len(label) <= 6 for label in labels)
    assert "".join(am.token_labels(tokenizer, ids, width=10_000)).replace("\\n", "\n").replace(
        "␣", " "
    ) == tokenizer.decode(ids)


@pytest.fixture(scope="module")
def model_dirs(corpus, tmp_path_factory):  # noqa: F811
    _, tok = corpus
    root = tmp_path_factory.mktemp("attention-models")
    bare = root / "no-tokenizer"
    from diffattn.checkpoint import save_model

    save_model(tiny_diffattn("baseline", vocab_size=tok.vocab_size), bare)
    return {
        "diff_v1": _save_diffattn(root / "diff_v1", tok, "diff_v1"),
        "llama": _save_hf(root / "llama", tok),
        "bare": bare,
    }


def test_command_writes_figures_and_the_probe_maps(model_dirs, tmp_path):
    from diffattn.cli import main
    from diffattn.eval.common import load_models

    out = tmp_path / "out"
    prompt = "def f(x):\n    return x + 1"
    argv = ["eval", "attention", str(model_dirs["diff_v1"]), "--compare", str(model_dirs["llama"])]
    argv += ["--prompt", prompt, "--layers", "1", "--heads", "1", "--query=-1,3", "--view", "both"]
    assert main([*argv, "--out", str(out), "--quiet"]) == 0
    values = json.loads((out / am.MAPS_NAME).read_text())
    record = json.loads((out / "results.json").read_text())
    assert record["experiment"] == "attention" and record["results"]["values"] == am.MAPS_NAME
    models = load_models([str(model_dirs["diff_v1"]), str(model_dirs["llama"])])
    for model in models:
        entry = values["models"][model.name]
        ids = model.tokenizer.encode(prompt, special=True)
        assert entry["token_ids"] == ids
        direct = am.capture_maps(model.model, ids, layers=[1], heads=[1], queries=None)
        assert list(entry["layers"]) == ["1"]
        n = len(ids)
        for layer, maps in direct.items():
            saved = entry["layers"][str(layer)]
            assert saved["query_positions"] == list(range(n))
            for name, tensor in maps.maps.items():  # fp32 values read back exactly
                assert torch.equal(torch.tensor(saved["heads"]["1"][name]), tensor[0])
            if "applied" in saved["heads"]["1"]:
                lam = torch.tensor(saved["lambda"])
                a1, a2 = (torch.tensor(saved["heads"]["1"][k]) for k in ("a1", "a2"))
                applied = torch.tensor(saved["heads"]["1"]["applied"])
                torch.testing.assert_close(applied, a1 - lam * a2, rtol=0, atol=1e-7)
            for stem in (f"q{n - 1}", "q3", "heatmap"):
                png = out / f"attention_{model.name}_L{layer}_{stem}.png"
                assert png.read_bytes()[:4] == b"\x89PNG"
        rows = record["results"]["models"][model.name]["rows"]
        assert {(r["layer"], r["head"], r["query"]) for r in rows} == {
            (1, 1, q) for q in (3, n - 1)
        }
    report = (out / "report.md").read_text()
    assert "top keys" in report and "attention_diff_v1_L1_q3.png" in report


def test_command_takes_token_ids_for_a_model_without_tokenizer(model_dirs, tmp_path):
    from diffattn.cli import main

    out = tmp_path / "ids"
    argv = ["eval", "attention", str(model_dirs["bare"]), "--token-ids", "1,2,3,4,5"]
    assert main([*argv, "--layers", "0", "--out", str(out), "--quiet"]) == 0
    entry = json.loads((out / am.MAPS_NAME).read_text())["models"]["no-tokenizer"]
    assert entry["tokens"] == ["#1", "#2", "#3", "#4", "#5"]
    assert list(entry["layers"]) == ["0"] and set(entry["layers"]["0"]["heads"]["0"]) == {"a"}
    assert (out / "attention_no-tokenizer_L0_q4.png").is_file()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prompt", "x = 1", "--layers", "7"], "--layers [7]: the model has 2 layers"),
        (["--prompt", "x = 1", "--heads", "0,9"], "--heads [9]: layer 0 has 2 heads"),
        (["--prompt", "x = 1", "--query", "500"], "--query [500]: the prompt has"),
        (["--prompt", "   "], "the prompt is empty"),
        (["--prompt", "x", "--view", "heatmap", "--query", "0"], "--query selects rows"),
        (["--token-ids", "1,99999"], "outside diff_v1's vocabulary"),
        (["--prompt", "x", "--max-labels", "0"], "--max-labels must be at least 1"),
    ],
)
def test_bad_input_is_one_line_and_leaves_out_alone(model_dirs, tmp_path, capsys, extra, message):
    from diffattn.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"experiment": "attention"}))
    (out / "keep.png").write_bytes(b"earlier")
    assert main(["eval", "attention", str(model_dirs["diff_v1"]), *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert (out / "keep.png").read_bytes() == b"earlier"


def test_model_without_tokenizer_needs_token_ids(model_dirs, tmp_path, capsys):
    from diffattn.cli import main

    argv = ["eval", "attention", str(model_dirs["bare"]), "--prompt", "hello"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no tokenizer is stored" in err and "--token-ids" in err
