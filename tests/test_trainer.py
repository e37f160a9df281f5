"""The :class:`Trainer`: step by step equals ``train()``, per-token validation losses,
``model_factory`` models under two-process DDP (a Hugging Face Llama) and FSDP2 (a factory
DiffTransformerLM and a Hugging Face Llama) equal to one process, and the layering of the
train package."""

from __future__ import annotations

import ast
import faulthandler
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from diffattn.train import Evaluation, TrainConfig, Trainer, read_metrics, shutdown, train
from extras import require_extra
from helpers import tiny_diffattn, tiny_hf

pytestmark = require_extra("train")

from train_helpers import REPO, free_port, tiny_recipe

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]

TOLERANCE = 1e-5


def test_steps_by_hand_equal_train(tmp_path, data_cache):
    config = TrainConfig.from_dict(tiny_recipe(data_cache, steps=3))
    reference = train(config, tmp_path / "run", progress=False)

    trainer = Trainer(config, tmp_path / "by-hand", progress=False).build()
    try:
        losses = {state.step: state.loss for state in (trainer.train_step() for _ in range(3))}
        checkpoint = trainer.save()
    finally:
        trainer.close()
    assert losses == pytest.approx(reference.losses, abs=0)
    assert checkpoint.name == reference.checkpoint.name and checkpoint.is_dir()


def test_evaluate_returns_per_token_losses_and_their_mean(tmp_path, data_cache):
    recipe = tiny_recipe(data_cache, steps=1, eval_every=1)
    trainer = Trainer(TrainConfig.from_dict(recipe), tmp_path / "run", progress=False)
    result = trainer.run()

    plain = trainer.evaluate()
    detailed = trainer.evaluate(return_token_losses=True)
    assert isinstance(plain, Evaluation) and plain.token_losses is None
    assert plain.loss == detailed.loss == result.val_losses[1]
    rows = recipe["eval_batches"] * recipe["global_batch_size"]
    assert detailed.token_losses.shape == (rows, recipe["seq_len"] - 1)
    assert bool((detailed.token_losses > 0).all())
    assert float(detailed.token_losses.double().mean()) == pytest.approx(plain.loss, abs=1e-5)


def test_validation_windows_are_spread_over_the_whole_held_out_stream(tmp_path, data_cache):
    """The trainer validates on windows spread evenly over the held-out stream (the windows
    ``diffattn compare`` measures on), not on its first windows."""
    from diffattn.data.loader import spread_windows
    from diffattn.probe import token_nll

    recipe = tiny_recipe(data_cache, steps=1, eval_every=1)
    trainer = Trainer(TrainConfig.from_dict(recipe), tmp_path / "run", progress=False)
    result = trainer.run()
    valid, seq = trainer.data.valid, recipe["seq_len"]
    count = recipe["eval_batches"] * recipe["global_batch_size"]
    picked = spread_windows(valid.num_tokens // seq, count)
    assert picked[-1] >= (valid.num_tokens // seq) * (count - 1) // count  # reaches the end
    rows = torch.cat(trainer.eval_list)
    expected = torch.stack([torch.as_tensor(valid.read(int(w) * seq, seq)) for w in picked])
    assert torch.equal(rows, expected.long())
    with torch.no_grad():
        model = trainer.model.eval()
        nll = torch.cat([token_nll(model(chunk).logits, chunk) for chunk in rows.split(4)])
    assert result.val_losses[1] == pytest.approx(float(nll.double().mean()), abs=1e-5)


# ----------------------------------------------------------------------------------------
# any nn.Module through DDP
def tiny_llama() -> torch.nn.Module:
    """A Hugging Face causal LM for the recipe's 512-token BPE."""
    return tiny_hf("llama", vocab_size=512)


def tiny_diff_v1() -> torch.nn.Module:
    """A DIFF V1 :class:`~diffattn.DiffTransformerLM` (blocks in ``.layers``) for the same BPE."""
    return tiny_diffattn("diff_v1", vocab_size=512)


RANK_TIMEOUT = 240
"""Seconds a spawned rank may run before it dumps its threads' stacks and exits."""


def _rank(rank: int, world: int, port: int, recipe: dict, out: str, factory) -> None:
    """One rank of a torchrun-like launch (torch.multiprocessing sets no variables)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    # a hang prints every thread's stack and ends the rank, instead of blocking the suite
    faulthandler.dump_traceback_later(RANK_TIMEOUT, exit=True)
    try:
        train(TrainConfig.from_dict(recipe), out, progress=False, model_factory=factory)
    finally:
        shutdown()
        faulthandler.cancel_dump_traceback_later()


def _two_ranks(recipe: dict, out: Path, factory) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, free_port(), recipe, str(out), factory), nprocs=2, join=True)


def _assert_same_records(reference_dir: Path, distributed_dir: Path) -> None:
    reference, records = read_metrics(reference_dir), read_metrics(distributed_dir)
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for ref, got in zip(reference, records, strict=True):
        for key in ("loss", "val_loss"):
            assert (key in ref) == (key in got)
            if key in ref:
                assert abs(ref[key] - got[key]) <= TOLERANCE, (ref["step"], key)


@pytest.mark.extra("hf")
def test_a_hugging_face_factory_checkpoint_loads_as_a_model(tmp_path, data_cache, capsys):
    """A factory-trained HF model's checkpoint is its ``save_pretrained`` directory (with the
    trainer's state beside it): ``from_pretrained``, ``diffattn eval`` and the loader read it,
    with the trained weights."""
    from transformers import AutoModelForCausalLM

    from diffattn import cli
    from diffattn.loading import resolve_source

    recipe = tiny_recipe(data_cache, steps=2, device="cpu")
    trained = []

    def factory():
        trained.append(tiny_llama())
        return trained[-1]

    train(TrainConfig.from_dict(recipe), tmp_path / "run", progress=False, model_factory=factory)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    assert resolve_source(tmp_path / "run").path == checkpoint  # the run stands for it
    assert resolve_source(checkpoint).kind == "hf"
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ids = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained[-1].eval()(ids).logits)
    out = tmp_path / "eval"
    args = ["eval", "loss", str(tmp_path / "run"), "--out", str(out), "--max-tokens", "500"]
    assert cli.main([*args, "--quiet"]) == 0
    assert json.loads((out / "results.json").read_text())["settings"]["seq_len"] == 32


@pytest.mark.extra("hf")
def test_factory_model_under_ddp_equals_one_process_and_resumes_alone(tmp_path, data_cache):
    recipe = tiny_recipe(data_cache, steps=4, eval_every=2, checkpoint_every=2, device="cpu")
    recipe["keep_last"] = None
    single = train(
        TrainConfig.from_dict(recipe), tmp_path / "single", progress=False, model_factory=tiny_llama
    )
    ddp_out = tmp_path / "ddp"
    _two_ranks({**recipe, "parallel": "ddp"}, ddp_out, tiny_llama)
    _assert_same_records(tmp_path / "single", ddp_out)

    # the DDP checkpoint of step 2 resumes in one process like the single-process run
    resumed_out = tmp_path / "resumed"
    shutil.copytree(ddp_out, resumed_out)
    shutil.rmtree(resumed_out / "checkpoints" / "step-00000004")
    resumed = train(
        TrainConfig.from_dict(recipe),
        resumed_out,
        resume=True,
        progress=False,
        model_factory=tiny_llama,
    )
    assert sorted(resumed.losses) == [3, 4]
    for step in (3, 4):
        assert abs(resumed.losses[step] - single.losses[step]) <= TOLERANCE


@pytest.mark.parametrize(
    "factory",
    # blocks in .layers; in .model.layers (Hugging Face)
    [tiny_diff_v1, pytest.param(tiny_llama, marks=pytest.mark.extra("hf"))],
    ids=["diff_v1", "hf_llama"],
)
def test_factory_model_under_fsdp2_equals_one_process(tmp_path, data_cache, factory):
    recipe = tiny_recipe(data_cache, steps=3, eval_every=3, device="cpu")
    train(
        TrainConfig.from_dict(recipe),
        tmp_path / "single",
        progress=False,
        model_factory=factory,
    )
    _two_ranks({**recipe, "parallel": "fsdp"}, tmp_path / "fsdp", factory)
    _assert_same_records(tmp_path / "single", tmp_path / "fsdp")
    # an HF model's checkpoint is its save_pretrained directory; any other keeps its state dict
    weights = "model.safetensors" if factory is tiny_llama else "model_state.safetensors"
    assert (tmp_path / "fsdp" / "checkpoints" / "step-00000003" / weights).is_file()


@pytest.mark.extra("hf", "peft")
def test_decoder_blocks_of_diffattn_hf_and_peft_models():
    from torch import nn

    from diffattn.train.parallel import decoder_blocks

    model = tiny_diff_v1()
    assert decoder_blocks(model) is model.layers
    with pytest.raises(ValueError, match=r"no nn\.ModuleList of decoder blocks"):
        decoder_blocks(nn.Linear(2, 2))
    llama = tiny_llama()
    assert decoder_blocks(llama) is llama.model.layers
    import peft

    wrapped = peft.get_peft_model(llama, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert decoder_blocks(wrapped) is wrapped.base_model.model.model.layers


# ----------------------------------------------------------------------------------------
# layering
def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_train_package_imports_neither_dex_nor_the_commands():
    for path in sorted((REPO / "src" / "diffattn" / "train").glob("*.py")):
        for name in _imported_modules(path):
            assert not name.startswith(("diffattn.dex", "diffattn.commands")), (path.name, name)
