"""Model directories: round trip, strict loading with named errors, atomic writes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffattn import DiffTransformerLM, ModelConfig
from diffattn.checkpoint import (
    CheckpointError,
    atomic_directory,
    load_model,
    read_config,
    save_model,
)


def tiny(attention: str = "diff_v1", **overrides) -> DiffTransformerLM:
    torch.manual_seed(0)
    fields = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    fields.update(overrides)
    return DiffTransformerLM(ModelConfig(attention=attention, **fields)).eval()


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_round_trip_is_exact_and_keeps_config(tmp_path, attention):
    model = tiny(attention, tie_embeddings=attention == "baseline")
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert loaded.config == model.config
    ids = torch.randint(0, 97, (2, 7))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert not loaded.training


def test_load_overrides_runtime_fields(tmp_path):
    save_model(tiny(), tmp_path / "m")
    assert load_model(tmp_path / "m", backend="reference").config.backend == "reference"


def write_weights(directory, mutate):
    file = directory / "model.safetensors"
    state = load_file(str(file))
    mutate(state)
    save_file(state, str(file))


def test_missing_extra_and_misshaped_tensors_are_named(tmp_path):
    save_model(tiny(), tmp_path / "m")

    def mutate(state):
        del state["model.layers.1.attn.lambda_q1"]
        state["model.layers.0.attn.bogus"] = torch.zeros(3)
        state["model.norm.weight"] = torch.ones(7)

    write_weights(tmp_path / "m", mutate)
    with pytest.raises(CheckpointError) as info:
        load_model(tmp_path / "m")
    message = str(info.value)
    assert "missing tensor(s): model.layers.1.attn.lambda_q1" in message
    assert "unexpected tensor(s): model.layers.0.attn.bogus" in message
    assert "model.norm.weight (expected (32,), found (7,))" in message


def test_pickle_checkpoint_is_refused_with_pointer_to_safetensors(tmp_path):
    save_model(tiny(), tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*safetensors"):
        load_model(tmp_path / "m")


def test_truncated_weights_are_named(tmp_path):
    save_model(tiny(), tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        load_model(tmp_path / "m")


def test_foreign_model_type_points_to_convert(tmp_path):
    save_model(tiny(), tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    data = json.loads(config.read_text())
    data["model_type"] = "llama"
    config.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"model_type is 'llama'.*diffattn convert"):
        load_model(tmp_path / "m")


def test_bad_config_values_and_keys_are_named(tmp_path):
    save_model(tiny(), tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "n_heads": 3}))
    with pytest.raises(CheckpointError, match="n_heads"):
        read_config(tmp_path / "m")
    config.write_text(json.dumps({**data, "colour": "red"}))
    with pytest.raises(CheckpointError, match="colour"):
        read_config(tmp_path / "m")
    config.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_config(tmp_path / "m")


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_model(tmp_path / "empty")


def test_save_refuses_non_empty_directory_and_leaves_it_untouched(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not empty"):
        save_model(tiny(), out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    save_model(tiny(), out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_failed_save_leaves_nothing_behind(tmp_path):
    def explode(path):
        path.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_model(tiny(), tmp_path / "m", extra_files={"extra.txt": explode})
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_old_directory(tmp_path):
    save_model(tiny(), tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "m", overwrite=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("interrupted")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_integer_tensor_for_a_float_parameter_is_refused(tmp_path):
    save_model(tiny(), tmp_path / "m")

    def mutate(state):
        state["model.norm.weight"] = torch.ones(32, dtype=torch.int32)

    write_weights(tmp_path / "m", mutate)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight \(expected torch\.float32, "):
        load_model(tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"found torch\.int32\)"):
        load_model(tmp_path / "m")


def test_bfloat16_weights_still_load_into_a_float32_model(tmp_path):
    save_model(tiny().to(torch.bfloat16), tmp_path / "m")
    assert load_model(tmp_path / "m").norm.weight.dtype == torch.float32


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_name_the_first_bad_tensor(tmp_path, value):
    save_model(tiny(), tmp_path / "m")

    def mutate(state):
        state["model.layers.1.attn.o_proj.weight"][0, 0] = value
        state["model.norm.weight"][3] = value

    write_weights(tmp_path / "m", mutate)
    with pytest.raises(
        CheckpointError, match=r"tensor model\.layers\.1\.attn\.o_proj\.weight holds"
    ):
        load_model(tmp_path / "m")


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "/tmp/outside.safetensors", "a/../../x"]
)
def test_index_entries_outside_the_directory_are_refused(tmp_path, shard):
    save_model(tiny(), tmp_path / "m")
    (tmp_path / "outside.safetensors").write_bytes(
        (tmp_path / "m" / "model.safetensors").read_bytes()
    )
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "part-1.safetensors")
    index = {
        "weight_map": {
            "model.norm.weight": shard,
            "model.embed_tokens.weight": "part-1.safetensors",
        }
    }
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="points outside the model directory"):
        load_model(tmp_path / "m")


def test_a_symlinked_shard_leading_outside_is_refused(tmp_path):
    save_model(tiny(), tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (tmp_path / "m" / "link.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    index = {"weight_map": {"model.norm.weight": "link.safetensors"}}
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="points outside the model directory"):
        load_model(tmp_path / "m")
