"""diffattn eval effective: the estimates' relation by hand and the command on a Dex model."""

from __future__ import annotations

import json

import pytest
import torch

from diffattn import dex
from diffattn.cli import main
from diffattn.data import train_bpe
from diffattn.dex.effective import effective_attention_nearest, effective_attention_pinv
from diffattn.eval.effective import invisible_share
from extras import require_extra
from helpers import tiny_hf

pytestmark = require_extra("hf")

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x = 1\n    y = 2\n" * 30


def _head(keys: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    attn = torch.softmax(torch.randn(1, keys, keys, generator=g, dtype=torch.float64), -1)
    values = torch.randn(1, keys, width, generator=g, dtype=torch.float64)
    w_d = torch.eye(width, dtype=torch.float64) + 0.1 * torch.randn(
        width, width, generator=g, dtype=torch.float64
    )
    return attn, values, w_d


def test_pinv_and_nearest_differ_by_the_part_of_a_that_v_cannot_see():
    attn, values, w_d = _head(keys=12, width=4)  # more keys than channels
    gap = effective_attention_nearest(attn, values, w_d, 0.3) - effective_attention_pinv(
        attn, values, w_d, 0.3
    )
    outside = attn - attn @ values @ torch.linalg.pinv(values)
    torch.testing.assert_close(gap, outside)
    assert invisible_share(attn, values) == pytest.approx(
        float(outside.norm() / attn.norm()), rel=1e-12
    )
    assert invisible_share(*_head(keys=4, width=8)[:2]) < 1e-12  # S ≤ d: nothing is invisible


@pytest.fixture(scope="module")
def dex_model(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("effective")
    bpe = train_bpe([TEXT] * 10, 300, cache_dir=root / "bpe")
    bpe.save(root / "tok")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(root / "tok" / "tokenizer.json"))
    model = tiny_hf("llama", vocab_size=bpe.vocab_size)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    dex.apply(model, heads={0: [1], 1: [0]}, anneal_steps=0, lambda_learn_init=0.5)
    dex.save_adapter(model, root / "adapter")
    (root / "data.txt").write_text(TEXT)
    return root


def test_command_reports_each_adapted_head(dex_model, tmp_path):
    out = tmp_path / "out"
    code = main(
        [
            "eval",
            "effective",
            str(dex_model / "base"),
            "--dex",
            str(dex_model / "adapter"),
            "--data",
            str(dex_model / "data.txt"),
            "--split",
            "all",
            "--seq-len",
            "24",
            "--max-tokens",
            "100",
            "--windows",
            "1",
            "--steps",
            "30",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    record = json.loads((out / "results.json").read_text())
    (result,) = record["results"]["models"].values()
    assert [(h["layer"], h["head"]) for h in result["heads"]] == [(0, 1), (1, 0)]
    for h in result["heads"]:
        assert h["residual_pinv"] <= h["residual_optim"] + 1e-9  # least squares is best
        assert h["lam"] == pytest.approx(0.5)
    assert (out / "effective_agreement.png").stat().st_size > 0


def test_a_model_without_dex_is_one_line(dex_model, tmp_path, capsys):
    code = main(
        [
            "eval",
            "effective",
            str(dex_model / "base"),
            "--data",
            str(dex_model / "data.txt"),
            "--split",
            "all",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 2 and "no Dex adapter" in capsys.readouterr().err


def test_effective_rows_are_softmax_rows_except_for_adapted_heads():
    from diffattn.dex.effective import effective_rows
    from diffattn.probe import AttentionMaps, HeadOutputs, Probe

    model = tiny_hf("llama", vocab_size=128)
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    dex.apply(model, heads={1: [2]}, anneal_steps=0, lambda_learn_init=0.5)
    rows = effective_rows(model, ids)
    maps, outputs = AttentionMaps(what=("probs", "values")), HeadOutputs(stages=("dex_output",))
    with torch.no_grad(), Probe(model, [maps, outputs]):
        model(input_ids=ids)
    probs = maps.result()[1][0]["probs.a"][0, :, -1].double()
    for head in (0, 1, 3):
        torch.testing.assert_close(rows[1][head], probs[head])
    values = maps.result()[1][0]["values"][0, 2 // 2].double()  # 4 heads, 2 KV groups
    out = outputs.result()[1][0]["dex_output"][0, 2, -1].double()
    # W_D starts at the identity, so O' = (1 − λ) A V lies in V's row space: X V = O' exactly
    torch.testing.assert_close(rows[1][2] @ values, out, rtol=1e-6, atol=1e-8)
