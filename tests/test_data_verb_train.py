"""Training on prepared shards: the shards' tokenizer must be the model's (a resumed checkpoint's
or an ``init_from`` model's), and under torchrun only rank 0 tokenises."""

from __future__ import annotations

import random
import shutil
import textwrap
from types import SimpleNamespace

import pytest

from extras import require_extra

pytestmark = [require_extra("train", "hf"), pytest.mark.usefixtures("one_thread")]

from train_helpers import tiny_recipe, torchrun_target, train_cli, write_recipe  # noqa: I001

from diffattn.data import DataConfig, prepare_data
from diffattn.data.tokenizer_match import tokenizer_mismatch


def _corpus(tmp_path, name, letters):
    """40 documents of made-up words over ``letters``: enough pairs for a 300-token BPE to fill
    its vocabulary, and other merges for other letters."""
    rng = random.Random(name)
    root = tmp_path / name
    root.mkdir()
    for i in range(40):
        words = ("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(40))
        (root / f"d{i:02d}.txt").write_text(" ".join(words) + "\n")
    return root


def _recipe(tmp_path, corpus, name="recipe.yaml", **changes):
    settings = {"steps": 2, "global_batch_size": 4, "micro_batch_size": None, "seq_len": 16}
    recipe = tiny_recipe(
        tmp_path / "cache",
        model={"vocab_size": 320, "n_layers": 1, "max_seq_len": 32},
        data={"sources": [str(corpus)], "tokenizer": "bpe:300", "max_bytes": None},
        schedule={"warmup_steps": 1, "total_steps": 4},
        **{**settings, **changes},
    )
    return write_recipe(tmp_path / name, recipe)


ALPHA = "abcdefghijklm"
OTHER = "nopqrstuvwxyz"


def _bpe(tmp_path, corpus, into):
    """A 300-token BPE learnt from ``corpus``, copied to ``into`` (replacing what is there)."""
    config = DataConfig(sources=[str(corpus)], tokenizer="bpe:300", cache_dir=str(tmp_path / "c"))
    shutil.copytree(
        prepare_data(config, progress=False).directory / "tokenizer", into, dirs_exist_ok=True
    )
    return into


def test_init_from_or_resume_with_another_tokenizer_is_refused_naming_both(tmp_path, capsys):
    a, b = _corpus(tmp_path, "a", ALPHA), _corpus(tmp_path, "b", OTHER)
    tokenizer = _bpe(tmp_path, a, tmp_path / "tokenizer")
    first = _recipe(tmp_path, a, steps=1)
    first.write_text(first.read_text().replace("bpe:300", f"hf:{tokenizer}"))
    assert train_cli(str(first), "--out", str(tmp_path / "run")) == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000001"
    other = _recipe(tmp_path, b, name="other.yaml")
    capsys.readouterr()
    argv = [str(other), "--set", f"init_from={checkpoint}", "--out", str(tmp_path / "run-b")]
    assert train_cli(*argv) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.startswith("diffattn train: error: data.tokenizer: ")
    assert "the shards' tokenizer bpe:300 (vocab 300, EOS 0) differs from the model's" in line
    assert f"in {checkpoint}: hf:{tokenizer} (vocab 300, EOS 0)" in line
    assert "encode the same text differently" in line
    assert not (tmp_path / "run-b").exists()  # refused before anything was written
    # the same recipe, its hf: tokenizer replaced by another: resuming is refused too
    _bpe(tmp_path, b, tokenizer)
    assert train_cli(str(first), "--out", str(tmp_path / "run"), "--resume") == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("diffattn train: error: data.tokenizer: the shards' tokenizer hf:")
    assert f"the model's in {checkpoint}: hf:{tokenizer}" in line


def test_the_check_compares_encodings_not_names(tmp_path):
    def prepared(corpus, vocab):
        config = DataConfig(
            sources=[str(corpus)], tokenizer=f"bpe:{vocab}", cache_dir=str(tmp_path / "cache")
        )
        return prepare_data(config, progress=False)

    a = prepared(_corpus(tmp_path, "a", ALPHA), 300)
    b = prepared(_corpus(tmp_path, "b", OTHER), 300)
    assert tokenizer_mismatch(a.tokenizer, a.train, a.directory / "tokenizer") is None
    assert "encode the same text" in tokenizer_mismatch(
        b.tokenizer, b.train, a.directory / "tokenizer"
    )
    c = prepared(tmp_path / "a", 320)
    assert "(vocab 320, EOS 0) differs" in tokenizer_mismatch(
        c.tokenizer, c.train, a.directory / "tokenizer"
    )
    assert tokenizer_mismatch(a.tokenizer, a.train, tmp_path) is None  # nothing saved there


WORKER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from diffattn.data import prepare, tokenizers
    from diffattn.train.cli import main

    log = Path(os.environ["TOKENISE_LOG"])
    rank = os.environ["RANK"]

    def counted(function, what):
        def wrapper(*args, **kwargs):
            with log.open("a") as handle:
                handle.write(f"{rank} {what}\\n")
            return function(*args, **kwargs)
        return wrapper

    prepare.write_token_shards = counted(prepare.write_token_shards, "shards")
    from tokenizers import trainers
    trainers.BpeTrainer = counted(trainers.BpeTrainer, "bpe")
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.slow
def test_torchrun_without_shards_tokenises_on_rank_0_only(tmp_path, monkeypatch):
    recipe = _recipe(tmp_path, _corpus(tmp_path, "a", ALPHA), parallel="ddp")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    log = tmp_path / "tokenise.log"
    monkeypatch.setenv("TOKENISE_LOG", str(log))
    done = torchrun_target([str(worker), str(recipe), "--out", str(tmp_path / "run"), "--quiet"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(log.read_text().splitlines()) == ["0 bpe", "0 shards"]
    assert len(list((tmp_path / "cache" / "shards").glob("*/prepared.json"))) == 1


def test_rank_0_prepares_before_the_barrier_and_the_others_after(monkeypatch):
    """The order of ``_build_data`` with two ranks simulated in one process."""
    from diffattn.train import building

    calls = []

    def fake_prepare(config, progress):
        calls.append(("prepare", rank, progress))
        return SimpleNamespace(tokenizer=SimpleNamespace(vocab_size=8))

    monkeypatch.setattr("diffattn.data.prepare_data", fake_prepare)
    monkeypatch.setattr(building.distributed, "barrier", lambda: calls.append(("barrier", rank)))
    for rank in (0, 1):
        trainer = building.TrainerBuilding()
        trainer.data, trainer.main, trainer.progress = None, rank == 0, True
        trainer._data_config, trainer.model_config = object(), None
        trainer.checkpoint_found = trainer.init_source = None
        trainer._build_data()
    assert calls == [
        ("prepare", 0, True),
        ("barrier", 0),
        ("barrier", 1),
        ("prepare", 1, False),
    ]


@pytest.mark.extra("tiktoken")
def test_a_tiktoken_encoding_matches_its_saved_hf_form(tmp_path):
    config = DataConfig(
        sources=["synthetic:recall?docs=20"],
        tokenizer="tiktoken:cl100k_base",
        valid_fraction=0.0,
        cache_dir=str(tmp_path / "cache"),
    )
    data = prepare_data(config, progress=False)
    saved = data.tokenizer.save(tmp_path / "model")
    assert tokenizer_mismatch(data.tokenizer, data.train, saved) is None
