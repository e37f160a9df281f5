"""Group-differentiated growth of GDA models (``diffattn.attention.gda_growth``) and
``diffattn convert --grow-signal-heads``.

* the grown model computes the original's logits (to fp32 rounding), with and without the
  symmetry-breaking perturbation, and its tensors are the oracle's ``grow_signal_heads``
  (with and without the W_O split);
* only GDA layers grow in a mixed stack; bad input is one ``ValueError``;
* the grown model trains: one optimizer step moves the copies of a head apart only with
  ``symmetry_noise > 0``;
* the command writes a directory that loads and computes the original's logits, and refuses
  other types (exit 2) without writing anything.
"""

from __future__ import annotations

import math

import pytest
import torch

from diffattn import DiffTransformerLM, ModelConfig
from diffattn.attention.gda import GDA
from diffattn.attention.gda_growth import grow_signal_heads
from diffattn.checkpoint import load_model, save_model
from diffattn.cli import main
from oracle import gda as oracle

TINY = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=8, head_dim=8, ffn_hidden=48)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gda_model(options: dict, n_kv_heads: int, seed: int = 0, **changes) -> DiffTransformerLM:
    """A GDA model with every parameter moved away from its init."""
    fields = {**TINY, "n_kv_heads": n_kv_heads, **changes}
    config = ModelConfig(attention="gda", attention_options={"gda": options}, **fields)
    torch.manual_seed(seed)
    model = DiffTransformerLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return model.eval()


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def grown_model(model, factor: int, **options) -> DiffTransformerLM:
    config, state = grow_signal_heads(model, model.config, factor, **options)
    grown = DiffTransformerLM(config)
    grown.load_state_dict(state)
    return grown.eval()


GROWTH = [
    ({"ratio": 1}, 4, 2),  # DIFF V1's layout -> GDA 2:1
    ({"ratio": 3}, 2, 3),  # 3:1 -> 9:1, one KV group
    ({"ratio": 2, "head_budget": "outputs"}, 4, 2),  # 2:1 -> 4:1
]


@pytest.mark.parametrize(("options", "n_kv", "factor"), GROWTH, ids=str)
@pytest.mark.parametrize("symmetry_noise", [0.0, 0.05])
def test_the_grown_model_computes_the_same_logits(options, n_kv, factor, symmetry_noise):
    model = gda_model(options, n_kv)
    gen = torch.Generator().manual_seed(1)
    grown = grown_model(model, factor, symmetry_noise=symmetry_noise, generator=gen)
    old, new = GDA.heads(model.config), GDA.heads(grown.config)
    assert (new.ratio, new.n_noise, new.n_signal) == (
        old.ratio * factor,
        old.n_noise,
        old.n_signal * factor,
    )
    ids = torch.randint(0, TINY["vocab_size"], (2, 23))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        after = grown(ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel_max(after[real], before[real]) <= 1e-5


@pytest.mark.parametrize(("options", "n_kv", "factor"), GROWTH, ids=str)
@pytest.mark.parametrize("split_output", [True, False])
def test_the_grown_tensors_are_the_oracles(options, n_kv, factor, split_output):
    """Without the split the oracle's layer computes ``factor`` times the old output
    (tests/test_oracle_gda.py); with it, the same."""
    model = gda_model(options, n_kv).double()
    config, state = grow_signal_heads(model, model.config, factor, split_output=split_output)
    params = {k: v.detach() for k, v in model.state_dict().items()}
    for layer in range(config.n_layers):
        prefix = f"layers.{layer}.attn"
        new_options, expected = oracle.grow_signal_heads(
            model.config, model.config.options_of("gda"), params, prefix, factor, split_output
        )
        assert config.options_of("gda") == new_options
        for name in ("q_proj.weight", "o_proj.weight", "k_proj.weight", "lambda_q1"):
            assert torch.equal(state[f"{prefix}.{name}"], expected[f"{prefix}.{name}"]), name


def test_only_gda_layers_grow_in_a_mixed_stack():
    model = gda_model({"ratio": 3}, 2, layer_types="gda,baseline")
    config, state = grow_signal_heads(model, model.config, 2)
    assert config.layer_types == ("gda", "baseline")
    before = model.state_dict()
    for name in ("q_proj.weight", "o_proj.weight"):  # the baseline layer, as it was
        assert torch.equal(state[f"layers.1.attn.{name}"], before[f"layers.1.attn.{name}"])
    assert (
        state["layers.0.attn.o_proj.weight"].shape[1]
        == 2 * before["layers.0.attn.o_proj.weight"].shape[1]
    )
    grown = DiffTransformerLM(config)
    grown.load_state_dict(state)


@pytest.mark.parametrize(
    ("attention", "factor", "match"),
    [
        ("diff_v1", 2, "GDA layers"),
        ("gda", 0, "integer >= 1"),
        ("gda", 1.5, "integer >= 1"),
    ],
)
def test_bad_growth_is_one_value_error(attention, factor, match):
    config = ModelConfig(attention=attention, n_kv_heads=4, **TINY)
    model = DiffTransformerLM(config)
    with pytest.raises(ValueError, match=match):
        grow_signal_heads(model, config, factor)


def test_a_mis_shaped_state_is_refused():
    model = gda_model({"ratio": 3}, 2)
    state = dict(model.state_dict())
    state["layers.0.attn.o_proj.weight"] = state["layers.0.attn.o_proj.weight"][:, :8]
    with pytest.raises(ValueError, match=r"o_proj\.weight has shape"):
        grow_signal_heads(state, model.config, 2)


def copies_apart(model, config) -> float:
    """How far apart the two copies of signal head 0 are (q rows and W_O columns)."""
    d, q_rows = config.dim_per_head, model.layers[0].attn.q_proj.weight
    wo = model.layers[0].attn.o_proj.weight
    return max(
        (q_rows[:d] - q_rows[d : 2 * d]).abs().max().item(),
        (wo[:, : 2 * d] - wo[:, 2 * d : 4 * d]).abs().max().item(),
    )


@pytest.mark.parametrize("symmetry_noise", [0.0, 0.05])
def test_one_step_moves_the_copies_apart_only_with_symmetry_noise(symmetry_noise):
    model = gda_model({"ratio": 1}, 4)
    gen = torch.Generator().manual_seed(2)
    grown = grown_model(model, 2, symmetry_noise=symmetry_noise, generator=gen).train()
    d = grown.config.dim_per_head
    q_rows = grown.layers[0].attn.q_proj.weight
    assert torch.equal(q_rows[:d], q_rows[d : 2 * d])  # copies: q rows 0 and 1 of group 0
    optimizer = torch.optim.SGD(grown.parameters(), lr=0.5)
    ids = torch.randint(0, TINY["vocab_size"], (2, 17))
    grown(ids, labels=ids).loss.backward()
    optimizer.step()
    q_apart = (q_rows[:d] - q_rows[d : 2 * d]).abs().max().item()
    if symmetry_noise == 0.0:
        assert q_apart == 0.0
    else:
        assert q_apart > 1e-4


# --- diffattn convert --grow-signal-heads ------------------------------------------------------


def test_command_grows_a_checkpoint(tmp_path, capsys):
    model = gda_model({"ratio": 3}, 2)
    save_model(model, tmp_path / "src")
    code = main(
        [
            "convert",
            str(tmp_path / "src"),
            str(tmp_path / "out"),
            "--grow-signal-heads",
            "2",
            "--symmetry-noise",
            "0.01",
        ]
    )
    assert code == 0, capsys.readouterr().err
    grown = load_model(tmp_path / "out").eval()
    assert grown.config.options_of("gda")["ratio"] == 6
    ids = torch.randint(0, TINY["vocab_size"], (1, 19))
    with torch.no_grad():
        assert rel_max(grown(ids).logits, model(ids).logits) <= 1e-5


@pytest.mark.parametrize(
    ("attention", "extra", "message"),
    [
        ("diff_v1", [], "applies to GDA models"),
        ("gda", ["--to", "hf-llama"], "writes a diffattn model directory"),
        ("gda", ["--grow-signal-heads", "0"], "grow-signal-heads"),
    ],
)
def test_command_refuses_without_writing(tmp_path, capsys, attention, extra, message):
    config = ModelConfig(attention=attention, n_kv_heads=2, **TINY)
    save_model(DiffTransformerLM(config), tmp_path / "src")
    argv = ["convert", str(tmp_path / "src"), str(tmp_path / "out")]
    if "--grow-signal-heads" not in extra:
        argv += ["--grow-signal-heads", "2"]
    code = main([*argv, *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists()
