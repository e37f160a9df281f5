"""Checkpoints and exact resume: atomic, pruned, loadable, and continuing bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from diffattn.checkpoint import load_model
from diffattn.train import ConfigError, TrainConfig, train
from diffattn.train.checkpoint import (
    TRAINER_STATE_NAME,
    list_checkpoints,
    load_trainer_state,
)
from extras import require_extra

pytestmark = require_extra("train")

from train_helpers import (
    read_losses,
    tiny_recipe,
    train_cli,
    write_recipe,
)

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]


_cli = train_cli


def test_resume_repeats_the_uninterrupted_losses(tmp_path, data_cache):
    """`--steps 12 --out A` vs `--steps 6 --out B` then `--steps 12 --out B --resume`."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_recipe(data_cache, eval_every=4))
    a, b = tmp_path / "A", tmp_path / "B"
    assert _cli(str(recipe), "--steps", "12", "--out", str(a)) == 0
    assert _cli(str(recipe), "--steps", "6", "--out", str(b)) == 0
    assert _cli(str(recipe), "--steps", "12", "--out", str(b), "--resume") == 0
    full, resumed = read_losses(a), read_losses(b)
    assert sorted(resumed) == list(range(1, 13))  # every step exactly once
    worst = max(abs(full[s] - resumed[s]) for s in range(7, 13))
    assert worst <= 1e-6, worst
    # λ trajectories and validation losses continue too
    records_a = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    records_b = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert records_a[-1]["lambda"] == pytest.approx(records_b[-1]["lambda"], abs=1e-6)
    assert records_a[-1]["val_loss"] == pytest.approx(records_b[-1]["val_loss"], abs=1e-6)
    assert records_a[-1]["tokens"] == records_b[-1]["tokens"] == 12 * 8 * 32


def test_checkpoints_are_model_directories_and_only_the_last_k_are_kept(tmp_path, data_cache):
    config = TrainConfig.from_dict(
        tiny_recipe(data_cache, steps=7, checkpoint_every=2, keep_last=2)
    )
    result = train(config, tmp_path / "run", progress=False)
    found = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [step for step, _ in found] == [6, 7]  # 2, 4 pruned; the final step is saved
    assert result.checkpoint == found[-1][1]
    assert not [p for p in found[-1][1].parent.iterdir() if p.name.startswith(".")]
    model = load_model(result.checkpoint)
    assert model.config == config.model_config()
    ids = torch.randint(0, 512, (2, 32))
    assert torch.isfinite(model(ids, labels=ids).loss)
    raw = torch.load(result.checkpoint / TRAINER_STATE_NAME, weights_only=True)
    assert raw["step"] == 7 and set(raw["rank_states"][0]) == {"rng", "loader"}
    assert "optimizer" in load_trainer_state(result.checkpoint)
    assert (result.checkpoint / "tokenizer.json").is_file()
    assert (result.checkpoint / "train_config.yaml").is_file()


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, data_cache, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(data_cache))
    assert _cli(str(recipe), "--out", str(tmp_path / "empty"), "--resume") == 2
    err = capsys.readouterr().err
    assert "error: resume: no checkpoint found" in err
    assert not (tmp_path / "empty").exists()


def test_resume_with_another_model_or_data_names_the_difference(tmp_path, data_cache, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(data_cache, steps=2))
    out = str(tmp_path / "run")
    assert _cli(str(recipe), "--out", out) == 0
    for override, expected in [
        ("model.n_layers=3", "error: model.n_layers: "),
        ("model.attention=baseline", "error: model.attention: "),
        ("seq_len=16", "error: seq_len: "),
        ("data.max_bytes=200000", "error: data: "),
    ]:
        code = _cli(str(recipe), "--out", out, "--resume", "--steps", "4", "--set", override)
        assert code == 2, override
        err = capsys.readouterr().err
        assert expected in err, err
    assert "n_layers: 2 (checkpoint) vs 3 (config)" in _message_for(recipe, out, "model.n_layers=3")
    # without --resume an existing run is not overwritten
    assert _cli(str(recipe), "--out", out) == 2
    assert "--resume" in capsys.readouterr().err


def _message_for(recipe, out, override) -> str:
    from diffattn.train import load_config

    with pytest.raises(ConfigError) as info:
        train(load_config(recipe, [override, "steps=4"]), out, resume=True, progress=False)
    return str(info.value)


def test_a_crash_loses_only_the_steps_after_the_last_checkpoint(tmp_path, data_cache):
    """What kill -9 leaves (a half-written checkpoint directory, metrics past the last
    checkpoint) is cleaned up, and the resumed run matches the uninterrupted one."""
    config = TrainConfig.from_dict(tiny_recipe(data_cache, steps=10, checkpoint_every=4))
    full = train(config, tmp_path / "full", progress=False).losses
    run = tmp_path / "crashed"
    train(config.replace(steps=6), run, progress=False)  # checkpoints at 4 and 6
    # simulate a crash after step 6 while writing step 8: drop checkpoint 6, leave debris
    root = run / "checkpoints"
    import shutil

    shutil.rmtree(root / "step-00000006")
    debris = root / ".step-00000008.tmp-abc"
    debris.mkdir()
    (debris / "model.safetensors").write_bytes(b"partial")
    resumed = train(config, run, resume=True, progress=False)
    assert not debris.exists()
    assert min(resumed.losses) == 5  # continued from step 4
    assert max(abs(full[s] - resumed.losses[s]) for s in range(5, 11)) <= 1e-6
    assert sorted(read_losses(run)) == list(range(1, 11))


def test_gradient_accumulation_and_activation_checkpointing_do_not_change_the_losses(
    tmp_path, data_cache
):
    from diffattn.train import read_metrics

    base = TrainConfig.from_dict(tiny_recipe(data_cache, steps=4, micro_batch_size=8))
    runs = {
        "one": base,
        "accumulated": base.replace(micro_batch_size=2),
        "recomputed": base.replace(activation_checkpointing=True),
    }
    records = {}
    for name, config in runs.items():
        train(config, tmp_path / name, progress=False)
        records[name] = read_metrics(tmp_path / name)
    for name in ("accumulated", "recomputed"):
        for ref, got in zip(records["one"], records[name], strict=True):
            # AdamW hardly sees a gradient scale, so the gradient norm is compared too
            assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_latest_and_final_entries_follow_the_run(tmp_path, data_cache):
    """``checkpoints/latest`` links the newest checkpoint, ``checkpoints/final`` the one of the
    last step; a run directory as MODEL is its final checkpoint; a resume that goes further
    keeps ``final`` until it writes a newer checkpoint, which moves it: away before the new
    last step, to the new last step's checkpoint there."""
    from diffattn.loading import training_run_checkpoint
    from diffattn.train.checkpoint import FINAL_ENTRY, LATEST_ENTRY, read_entry

    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(data_cache, checkpoint_every=2))
    out = tmp_path / "run"
    root = out / "checkpoints"
    assert _cli(str(recipe), "--steps", "4", "--out", str(out), "--quiet") == 0
    step4 = root / "step-00000004"
    assert (root / LATEST_ENTRY).is_symlink() and read_entry(root, LATEST_ENTRY) == step4
    assert read_entry(root, FINAL_ENTRY) == step4
    assert training_run_checkpoint(out) == step4
    assert load_model(root / FINAL_ENTRY).config == load_model(step4).config
    assert [s for s, _ in list_checkpoints(root)] == [2, 4]  # the links are no checkpoints

    from diffattn.train import load_config
    from diffattn.train.trainer import Trainer

    config = load_config(recipe, ["steps=6"])
    trainer = Trainer(config, out, resume=True, progress=False).build()
    assert read_entry(root, FINAL_ENTRY) == step4  # nothing newer is written yet
    assert read_entry(root, LATEST_ENTRY) == step4
    trainer.train_step()
    trainer.save()  # step 5, before the new last step: the run went past step 4
    assert read_entry(root, FINAL_ENTRY) is None and not (root / FINAL_ENTRY).is_symlink()
    assert read_entry(root, LATEST_ENTRY) == root / "step-00000005"
    assert training_run_checkpoint(out) == root / "step-00000005"
    trainer.close()
    assert _cli(str(recipe), "--steps", "6", "--out", str(out), "--resume", "--quiet") == 0
    assert read_entry(root, FINAL_ENTRY) == read_entry(root, LATEST_ENTRY) == root / "step-00000006"


def test_a_resume_that_fails_before_saving_keeps_the_final_entry(tmp_path, data_cache, capsys):
    """A resume that stops on a non-finite loss before its first save leaves ``final`` (and
    ``latest``) on the finished run's last checkpoint, which the run directory still names."""
    from diffattn.loading import training_run_checkpoint
    from diffattn.train.checkpoint import FINAL_ENTRY, LATEST_ENTRY, read_entry

    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(data_cache, checkpoint_every=4))
    out = tmp_path / "run"
    root = out / "checkpoints"
    assert _cli(str(recipe), "--steps", "4", "--out", str(out)) == 0
    step4 = root / "step-00000004"
    assert read_entry(root, FINAL_ENTRY) == step4
    capsys.readouterr()
    # a learning rate of 1e30 makes the weights overflow: the loss of step 6 is not finite
    resumed = [str(recipe), "--steps", "8", "--out", str(out), "--resume"]
    assert _cli(*resumed, "--set", "optim.lr=1e30") == 1
    assert "non-finite loss" in capsys.readouterr().err
    assert [s for s, _ in list_checkpoints(root)] == [4]  # nothing was written
    assert read_entry(root, FINAL_ENTRY) == read_entry(root, LATEST_ENTRY) == step4
    assert training_run_checkpoint(out) == step4


def test_resume_from_a_named_step_sets_the_newer_checkpoints_aside(tmp_path, data_cache):
    """``--resume 4`` continues from step 4 exactly (the losses of steps 5–8 repeat those of
    the first run), the checkpoints after it are moved to ``superseded/``, not deleted."""
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(data_cache, checkpoint_every=2))
    out = tmp_path / "run"
    root = out / "checkpoints"
    assert _cli(str(recipe), "--steps", "8", "--out", str(out), "--quiet") == 0
    first = read_losses(out)
    assert _cli(str(recipe), "--steps", "8", "--out", str(out), "--resume", "4", "--quiet") == 0
    again = read_losses(out)
    assert sorted(again) == list(range(1, 9))
    assert max(abs(first[s] - again[s]) for s in range(5, 9)) <= 1e-6
    assert sorted(p.name for p in (out / "superseded").iterdir()) == [
        "step-00000006",
        "step-00000008",
    ]
    assert [s for s, _ in list_checkpoints(root)] == [4, 6, 8]  # keep_last 3
    # resuming again from 4 keeps both earlier futures under distinct names
    assert _cli(str(recipe), "--steps", "6", "--out", str(out), "--resume", "4", "--quiet") == 0
    assert len(list((out / "superseded").iterdir())) == 4


def test_resume_from_a_step_without_a_checkpoint_names_the_steps(tmp_path, data_cache, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(data_cache, checkpoint_every=2))
    out = tmp_path / "run"
    assert _cli(str(recipe), "--steps", "4", "--out", str(out), "--quiet") == 0
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert _cli(str(recipe), "--out", str(out), "--resume", "3") == 2
    err = capsys.readouterr().err
    assert "error: resume: no checkpoint of step 3 in" in err and "(its steps: 2, 4)" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert _cli(str(recipe), "--out", str(out), "--resume", "3", "--resume-fallback") == 2
    assert "--resume STEP names one checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli(str(recipe), "--out", str(out), "--resume", "x")
    assert "expected a checkpoint's step (a positive integer), got 'x'" in capsys.readouterr().err
