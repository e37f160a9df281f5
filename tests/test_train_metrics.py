"""metrics.jsonl fields, λ probes, loss spikes, step callbacks, TensorBoard, shared data."""

from __future__ import annotations

import math

import pytest
import torch

from diffattn import DiffTransformerLM, ModelConfig
from diffattn.flops import flops_per_token
from diffattn.train import TrainConfig, read_metrics, train
from diffattn.train.metrics import LambdaProbe, SpikeDetector
from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import (
    tiny_recipe,
)

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]


BASE_FIELDS = {
    "step",
    "loss",
    "loss_mean",
    "lr",
    "grad_norm",
    "tokens",
    "tokens_per_s",
    "step_time_s",
    "elapsed_s",
    "loss_spikes",
}


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_metrics_records_per_attention_type(tmp_path, data_cache, attention):
    config = TrainConfig.from_dict(
        tiny_recipe(
            data_cache,
            steps=6,
            log_every=2,
            eval_every=3,
            model={"attention": attention},
        )
    )
    result = train(config, tmp_path / "run", progress=False)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [2, 3, 4, 6]  # log steps plus eval steps
    for record in records:
        assert set(record) >= BASE_FIELDS
        assert record["tokens"] == record["step"] * 8 * 32
        assert record["tokens_per_s"] > 0 and record["grad_norm"] > 0
        assert isinstance(record["loss_spikes"], int)
        # the model's training FLOPs (3x forward, diffattn.flops) at that rate
        flops = flops_per_token(config.model_config(), config.seq_len).training
        tflops = flops * record["tokens_per_s"] / 1e12
        assert record["model_tflops_per_rank"] == pytest.approx(tflops, rel=1e-9)
        assert "mfu" not in record  # a CPU has no known peak
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert result.val_losses == {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert result.final == records[-1]
    assert records[0]["lr"] == pytest.approx(3e-3)  # end of the 2 warmup steps
    last = records[-1]
    if attention == "baseline":
        assert "lambda" not in last and "lambda_mean" not in last
    elif attention == "diff_v1":
        # λ starts near λ_init = 0.2, 0.3555 (Eq.2 with λ vectors ~ N(0, 0.1²))
        assert last["lambda"] == pytest.approx([0.2, 0.3555], abs=0.1)
    else:
        assert len(last["lambda_mean"]) == 2
        assert all(0.0 < x < 1.0 for x in last["lambda_mean"])


def test_v2_lambda_probe_is_the_mean_sigmoid_of_the_projection():
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, attention="diff_v2")
    model = DiffTransformerLM(config)
    probe = LambdaProbe(model)
    x = torch.randint(0, 64, (2, 8))
    with probe.capture():
        out = model(x, output_hidden_states=True)
    model(x)  # not captured
    got = probe.collect(torch.device("cpu"))["lambda_mean"]
    with torch.no_grad():
        for layer, hidden in enumerate(out.hidden_states[:2]):
            block = model.layers[layer]
            expected = torch.sigmoid(block.attn.lambda_proj(block.attn_norm(hidden))).mean()
            assert got[layer] == pytest.approx(float(expected), abs=1e-6)
    assert all(math.isnan(v) for v in probe.collect(torch.device("cpu"))["lambda_mean"])
    probe.remove()


def test_v1_lambda_probe_reads_lambda_full():
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, attention="diff_v1")
    model = DiffTransformerLM(config)
    got = LambdaProbe(model).collect(torch.device("cpu"))["lambda"]
    assert got == pytest.approx([b.attn.lambda_full().item() for b in model.layers])


def test_spike_detector_counts_jumps_over_the_running_median():
    detector = SpikeDetector(factor=2.0, window=20)
    flags = [detector.update(x) for x in [3.0] * 12 + [7.0, 3.0, 5.0, 6.5]]
    assert flags == [False] * 12 + [True, False, False, True]
    assert detector.count == 2
    again = SpikeDetector(factor=2.0, window=20)
    again.load_state_dict(detector.state_dict())
    assert again.update(10.0) == detector.update(10.0)


def test_callbacks_run_after_each_optimizer_step_and_can_log_and_stop(tmp_path, data_cache):
    seen = []

    def hook(state):
        assert state.model.training
        seen.append((state.step, state.lr, state.optimizer.state_dict()["state"] != {}))
        state.metrics["custom"] = state.step * 10
        if state.step == 4:
            state.stop = True

    config = TrainConfig.from_dict(tiny_recipe(data_cache, steps=9))
    result = train(config, tmp_path / "run", progress=False, callbacks=[hook])
    assert [s for s, _, _ in seen] == [1, 2, 3, 4]
    assert all(stepped for _, _, stepped in seen)  # AdamW already has state: after step()
    assert result.stopped == "callback" and result.step == 4
    assert result.checkpoint.name == "step-00000004"
    assert [r["custom"] for r in read_metrics(tmp_path / "run")] == [10, 20, 30, 40]


def test_three_models_on_the_same_prepared_data(tmp_path, data_cache):
    """What a comparison does: one preparation, identical order and seed for each model."""
    from diffattn.data import prepare_data

    config = TrainConfig.from_dict(tiny_recipe(data_cache, steps=3))
    data = prepare_data(config.data_config(), progress=False)
    results = {}
    for attention in ("baseline", "diff_v1", "diff_v2"):
        run = TrainConfig.from_dict(
            {**config.to_dict(), "model": {**config.model.to_dict(), "attention": attention}}
        )
        results[attention] = train(run, tmp_path / attention, progress=False, data=data)
    again = train(config, tmp_path / "again", progress=False, data=data)
    assert again.losses == results["diff_v1"].losses  # deterministic on CPU
    # matched sizes (V1 adds only its λ vectors and head-norm weights)
    assert results["diff_v1"].num_parameters == pytest.approx(
        results["baseline"].num_parameters, rel=0.005
    )
    assert results["diff_v2"].num_parameters > results["baseline"].num_parameters


@pytest.mark.extra("tensorboard")
def test_tensorboard_event_files(tmp_path, data_cache):
    config = TrainConfig.from_dict(tiny_recipe(data_cache, steps=2, tensorboard=True))
    train(config, tmp_path / "run", progress=False)
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_compiled_checkpointed_blocks_train_like_eager_blocks(tmp_path, data_cache):
    """torch.compile per block (with activation checkpointing) keeps losses and V2's λ."""
    config = TrainConfig.from_dict(
        tiny_recipe(data_cache, steps=3, eval_every=3, model={"attention": "diff_v2"})
    )
    eager = train(config, tmp_path / "eager", progress=False)
    compiled = train(
        config.replace(compile=True, activation_checkpointing=True),
        tmp_path / "compiled",
        progress=False,
    )
    for step, loss in eager.losses.items():
        assert compiled.losses[step] == pytest.approx(loss, abs=1e-5)
    assert compiled.final["lambda_mean"] == pytest.approx(eager.final["lambda_mean"], abs=1e-5)
    assert compiled.final["val_loss"] == pytest.approx(eager.final["val_loss"], abs=1e-5)


TOY = "toy_softmax"


@pytest.fixture
def toy_type():
    from diffattn.attention.baseline import Baseline
    from diffattn.attention.types import register_attention_type, unregister_attention_type

    class ToySoftmax(Baseline):
        name = TOY
        title = "Toy softmax"

    yield register_attention_type(ToySoftmax())
    unregister_attention_type(TOY)


def test_lambda_probe_records_each_layer_of_a_mixed_stack_by_its_type():
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=64, d_model=32, n_layers=3, n_heads=4, layer_types="diff_v2,baseline,diff_v1"
    )
    model = DiffTransformerLM(config)
    probe = LambdaProbe(model)
    with probe.capture():
        model(torch.randint(0, 64, (2, 9)))
    got = probe.collect(torch.device("cpu"))
    assert probe.key == "lambda_mean" and set(got) == {"lambda", "lambda_mean"}
    lam = got["lambda"]
    assert math.isnan(lam[0]) and math.isnan(lam[1])
    assert lam[2] == pytest.approx(model.layers[2].attn.lambda_full().item())
    means = got["lambda_mean"]
    assert 0.0 < means[0] < 1.0 and math.isnan(means[1]) and math.isnan(means[2])
    probe.remove()


@pytest.mark.parametrize(
    "model", [{"attention": TOY}, {"layer_types": "diff_v1,diff_v2"}], ids=["toy", "mixed"]
)
def test_metrics_of_a_registered_type_and_of_a_mixed_stack(tmp_path, data_cache, toy_type, model):
    recipe = tiny_recipe(data_cache, steps=2, log_every=2, eval_every=2, model=model)
    train(TrainConfig.from_dict(recipe), tmp_path / "run", progress=False)
    (record,) = read_metrics(tmp_path / "run")
    assert set(record) >= BASE_FIELDS and math.isfinite(record["loss"])
    lambdas = {k: v for k, v in record.items() if k.startswith("lambda")}
    if "attention" in model:
        assert lambdas == {}  # a softmax type has no λ
        return
    # layer 0 is DIFF V1 (λ of Eq.2 near λ_init = 0.2), layer 1 DIFF V2 (mean token λ)
    assert lambdas["lambda"][0] == pytest.approx(0.2, abs=0.1)
    assert math.isnan(lambdas["lambda"][1]) and math.isnan(lambdas["lambda_mean"][0])
    assert 0.0 < lambdas["lambda_mean"][1] < 1.0
