"""``diffattn eval heads``: the metric functions on crafted inputs, the streamed figures against
direct computation, the command, and the Dex figure on a Dex-wrapped tiny Llama."""

from __future__ import annotations

import json

import pytest
import torch
from tests.helpers import tiny_hf
from tests.test_eval_outliers import _save_diffattn, _save_hf, corpus  # noqa: F401

from diffattn.eval import heads
from diffattn.eval.common import EvalModel, TextTokenizer


def _causal_uniform(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    maps = allowed.double() / allowed.sum(-1, keepdim=True)
    return maps[None, None], allowed[None, None]


def test_sparsity_of_uniform_causal_map():
    maps, allowed = _causal_uniform(8)
    # every allowed entry is 1/i ≥ 1/8: none below ε in (0, 1/8]; all below ε > 1
    assert heads.sparsity_ratio(maps, allowed, 1e-4).tolist() == [0.0]
    assert heads.sparsity_ratio(maps, allowed, 1 / 8).tolist() == [0.0]
    assert heads.sparsity_ratio(maps, allowed, 1.01).tolist() == [1.0]
    # masked zeros do not count
    below, total = heads.sparsity_counts(maps, allowed, 1e-4)
    assert below.tolist() == [0.0] and total.tolist() == [36.0]
    # a one-hot row map: all but one entry per row are zero
    onehot = torch.eye(8, dtype=torch.float64)[None, None]
    assert heads.sparsity_ratio(onehot, allowed, 1e-6).item() == pytest.approx(28 / 36)


def test_sign_shares():
    maps = torch.tensor([[[[0.5, -0.25, 0.0], [1.0, -0.5, -0.5]]]], dtype=torch.float64)
    allowed = torch.tensor([[[[True, True, False], [True, True, True]]]])
    shares = heads.sign_shares(heads.sign_sums(maps, allowed))
    assert shares["positive_share"].item() == pytest.approx(2 / 5)
    assert shares["negative_share"].item() == pytest.approx(3 / 5)
    assert shares["positive_mean"].item() == pytest.approx(0.75)
    assert shares["negative_mean"].item() == pytest.approx(1.25 / 3)
    softmax, allowed = _causal_uniform(4)
    none = heads.sign_shares(heads.sign_sums(softmax, allowed))
    assert none["negative_share"].item() == 0.0 and torch.isnan(none["negative_mean"]).all()


def test_cosine_distance():
    torch.manual_seed(0)
    a = torch.rand(5, 6)
    maps = torch.stack([a, a, 3 * a, torch.rand(5, 6)])
    d = heads.cosine_distance(maps)
    assert torch.allclose(d[:3, :3], torch.zeros(3, 3, dtype=torch.float64), atol=1e-12)
    assert d[0, 3] > 0 and torch.allclose(d, d.T)
    orthogonal = torch.stack([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])])
    assert heads.cosine_distance(orthogonal)[0, 1].item() == pytest.approx(1.0)


def test_linear_cka():
    torch.manual_seed(0)
    x, y = torch.randn(50, 4), torch.randn(50, 4)
    assert heads.linear_cka(x, x) == pytest.approx(1.0)
    assert heads.linear_cka(x, 2.5 * x + 1.0) == pytest.approx(1.0)
    assert heads.linear_cka(x, 3.0 * y) == pytest.approx(heads.linear_cka(x, y))
    q, _ = torch.linalg.qr(torch.randn(4, 4))
    assert heads.linear_cka(x, x @ q) == pytest.approx(1.0)  # orthogonal invariance
    outputs = torch.stack([x, y, 2 * x])  # (H=3, N, w)
    matrix = heads.cka_matrix(outputs)
    assert torch.allclose(matrix.diagonal(), torch.ones(3, dtype=torch.float64))
    assert matrix[0, 1].item() == pytest.approx(heads.linear_cka(x, y))
    assert matrix[0, 2].item() == pytest.approx(1.0)


def test_dex_shift():
    o = torch.randn(2, 7, 4)
    cos, ratio = heads.dex_shift(o, 0.5 * o)  # Δ = −O/2
    assert torch.allclose(cos, torch.full((2,), -1.0, dtype=torch.float64))
    assert torch.allclose(ratio, torch.full((2,), 0.5, dtype=torch.float64))


@pytest.fixture(scope="module")
def model_dir(corpus, tmp_path_factory):  # noqa: F811
    _, tok = corpus
    return _save_diffattn(tmp_path_factory.mktemp("heads") / "diff_v2", tok, "diff_v2")


def test_streamed_figures_match_direct(model_dir, corpus):  # noqa: F811
    from diffattn.eval.common import load_models
    from diffattn.eval.loss import documents
    from diffattn.probe import AttentionMaps, HeadOutputs, Probe

    data, _ = corpus
    (model,) = load_models([str(model_dir)])
    pieces = heads.model_windows(model, documents([str(data)], "all", 0.02, 0), 24, 100)
    got = heads.analyse_model(model, pieces, batch_size=2)
    maps, outputs = AttentionMaps(what=("applied",)), HeadOutputs()
    with torch.no_grad(), Probe(model.model, [maps, outputs]):
        for piece in pieces:  # one window per forward: no padding
            model.model(input_ids=torch.tensor([piece]))
    layer = 1
    applied = [call["applied"][0] for call in maps.result()[layer]]  # (H, N, N) each
    n = [a.shape[-1] for a in applied]
    allowed = [torch.ones(k, k, dtype=torch.bool).tril()[None, None] for k in n]
    below = sum(
        heads.sparsity_counts(a[None], m, 1e-4)[0] for a, m in zip(applied, allowed, strict=True)
    )
    total = sum(
        heads.sparsity_counts(a[None], m, 1e-4)[1] for a, m in zip(applied, allowed, strict=True)
    )
    assert torch.allclose(got["sparsity"]["0.0001"][layer], below / total)
    distance = sum(heads.cosine_distance(a) for a in applied) / len(applied)
    assert torch.allclose(got["cosine_distance"][layer], distance, atol=1e-6)
    per_head = torch.cat([call["output"][0] for call in outputs.result()[layer]], 1)
    assert torch.allclose(got["cka"][layer], heads.cka_matrix(per_head), atol=1e-6)
    shares = got["positive_share"] + got["negative_share"]
    assert bool(((shares > 0) & (shares <= 1 + 1e-12)).all())
    assert set(got["entropy"]) == {"applied", "a1", "a2"}
    assert torch.equal(got["importance_sorted"][:, 0], torch.ones(2, dtype=torch.float64))


def test_cli_writes_outputs(model_dir, corpus, tmp_path):  # noqa: F811
    from diffattn.cli import main

    data, _ = corpus
    out = tmp_path / "out"
    argv = ["eval", "heads", str(model_dir), "--out", str(out), "--data", str(data)]
    code = main([*argv, "--split", "all", "--seq-len", "24", "--max-tokens", "100", "--quiet"])
    assert code == 0
    record = json.loads((out / "results.json").read_text())
    entry = next(iter(record["results"]["models"].values()))
    assert len(entry["entropy"]["applied"]) == 2 and set(entry["cka"]) == {"0", "1"}
    for name in ("entropy", "sparsity", "importance", "cosine_distance", "cka"):
        assert (out / f"{name}.png").stat().st_size > 0
    assert not (out / "dex_shift.png").exists()
    assert record["settings"]["layer"] == 1


def test_cli_bad_layer_is_one_line(model_dir, corpus, tmp_path, capsys):  # noqa: F811
    from diffattn.cli import main

    data, _ = corpus
    argv = ["eval", "heads", str(model_dir), "--out", str(tmp_path / "o"), "--data", str(data)]
    assert main([*argv, "--layer", "5", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--layer" in err


def test_dex_figure(corpus, tmp_path):  # noqa: F811
    import diffattn.dex

    data, tok = corpus
    model = tiny_hf("llama", vocab_size=tok.vocab_size)
    diffattn.dex.apply(model, heads={0: [1]}, anneal_steps=0, lambda_learn_init=0.5)
    wrapped = EvalModel("dex", "dex", model.eval(), TextTokenizer(tok.backend), "dex", "llama")
    results = heads.run([wrapped], data=[str(data)], split="all", seq_len=24, max_tokens=100)
    points = results["models"]["dex"]["dex"]
    # identity W_D and λ = 0.5: O' = O − 0.5·O, so Δ = −O/2
    assert [(p["layer"], p["head"]) for p in points] == [(0, 1)]
    assert points[0]["cosine"] == pytest.approx(-1.0, abs=1e-5)
    assert points[0]["relative_norm"] == pytest.approx(0.5, rel=1e-4)
    path = heads.plot_dex(results, tmp_path / "dex_shift.png")
    assert path is not None and path.stat().st_size > 0
    assert "Fig 11a" in heads.report(results)


def test_probe_importance_equals_dex_head_importance():
    from diffattn.dex.selection import head_importance
    from diffattn.probe.analysis import head_importance as probe_importance

    model = tiny_hf("llama")
    ids = torch.randint(0, 100, (3, 12))
    mask = torch.ones_like(ids)
    mask[2, 8:] = 0
    expected = head_importance(model, {"input_ids": ids, "attention_mask": mask})
    got = probe_importance(model, [(ids, mask)])
    assert torch.allclose(got.float(), expected, rtol=1e-5, atol=1e-8)


def test_a_mixed_stack_reports_its_softmax_layers(corpus, tmp_path):  # noqa: F811
    """``layer_types="diff_v1,baseline"``: every figure per layer; A1/A2 entropies NaN at the
    softmax layer (a V1 layer has half as many, wider heads), said in the report."""
    from tests.helpers import tiny_diffattn

    from diffattn.eval.loss import documents

    data, tok = corpus
    model = tiny_diffattn(layer_types="diff_v1,baseline", vocab_size=tok.vocab_size)
    wrapped = TextTokenizer(tok._tokenizer)  # the tokenizers.Tokenizer a saved model loads as
    loaded = EvalModel("mixed", "mixed", model, wrapped, "diffattn", "mixed")
    pieces = heads.model_windows(loaded, documents([str(data)], "all", 0.02, 0), 24, 60)
    got = heads.analyse_model(loaded, pieces, batch_size=2)
    assert got["one_map_layers"] == [1]
    h = model.config.n_heads
    for name in ("a1", "a2"):
        assert torch.isnan(got["entropy"][name][1]).all()
        assert not torch.isnan(got["entropy"][name][0, : h // 2]).any()
    assert not torch.isnan(got["entropy"]["applied"][1]).any()
    importance = got["importance"]
    assert importance.shape == (2, h) and torch.isnan(importance[0, h // 2 :]).all()
    assert torch.equal(got["importance_sorted"][:, 0], torch.ones(2, dtype=torch.float64))
    assert torch.isnan(got["importance_sorted"][0, h // 2 :]).all()
    text = heads.report({"models": {"mixed": got}})
    assert "Layers 1 are softmax layers of a mixed stack" in text
