"""diffattn eval hessian: power iteration finds known eigenvalues; the command's outputs."""

from __future__ import annotations

import json

import pytest
import torch

from diffattn.checkpoint import save_model
from diffattn.cli import main
from diffattn.data import train_bpe
from diffattn.eval.hessian import chosen_parameters, dominant_eigenvalue
from helpers import tiny_diffattn

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x = 1\n    y = 2\n" * 30


@pytest.mark.parametrize(
    ("diagonal", "expected"), [((3.0, -5.0, 1.0), -5.0), ((2.0, 0.5, 7.0), 7.0)]
)
def test_power_iteration_finds_the_eigenvalue_of_largest_magnitude(diagonal, expected):
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64))
    a = q @ torch.diag(torch.tensor(diagonal, dtype=torch.float64)) @ q.T  # same spectrum
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    value, steps = dominant_eigenvalue(
        lambda: 0.5 * x @ a @ x,
        [x],
        iters=500,
        tol=1e-10,
        generator=torch.Generator().manual_seed(1),
    )
    assert value == pytest.approx(expected, rel=1e-6)
    assert steps < 500


def test_bad_settings_and_parameter_sets():
    x = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="iters"):
        dominant_eigenvalue(lambda: (x * x).sum(), [x], iters=0)
    model = tiny_diffattn("diff_v1")
    attention = chosen_parameters(model, "attention")
    assert 0 < len(attention) < len(chosen_parameters(model, "all"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hessian")
    tokenizer = train_bpe([TEXT] * 10, 300, cache_dir=root / "bpe")
    model = tiny_diffattn("diff_v2", vocab_size=tokenizer.vocab_size)
    (root / "data.txt").write_text(TEXT)
    return save_model(model, root / "model", tokenizer=tokenizer), root / "data.txt"


def test_command_writes_the_spectrum(model_dir, tmp_path):
    directory, data = model_dir
    out = tmp_path / "out"
    code = main(
        [
            "eval",
            "hessian",
            str(directory),
            "--data",
            str(data),
            "--split",
            "all",
            "--seq-len",
            "32",
            "--max-tokens",
            "400",
            "--batch-size",
            "2",
            "--batches",
            "3",
            "--iters",
            "8",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    result = json.loads((out / "results.json").read_text())["results"]["models"]["model"]
    assert len(result["eigenvalues"]) == 3 and 0 <= result["negative_share"] <= 1
    assert all(1 <= s <= 8 for s in result["iterations"])
    assert (out / "hessian_spectra.png").stat().st_size > 0
    code = main(
        [
            "eval",
            "hessian",
            str(directory),
            "--data",
            str(data),
            "--split",
            "all",
            "--seq-len",
            "32",
            "--max-tokens",
            "100",
            "--batches",
            "50",
            "--out",
            str(tmp_path / "bad"),
            "--quiet",
        ]
    )
    assert code == 2
