"""``diffattn train`` on token files megatron-core and datatrove wrote: a tiny run with
``document_masking`` on each format gives exactly the losses of a run on the same tokens
written as diffattn shards (the same windows in the same batches), and a corrupt token file
stops the command with one line naming it (exit code 2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from extras import require_extra

pytestmark = require_extra("formats", "train", "hf")

import numpy as np
import torch

from diffattn import cli
from diffattn.data import BatchLoader, ShardWriter, documents_after_eos, prepare_data
from test_data_external import EOS, documents, word_tokenizer, write_datatrove, write_megatron
from train_helpers import tiny_recipe, write_recipe

pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]

VOCAB = 500


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return word_tokenizer(tmp_path_factory.mktemp("tokenizer"), VOCAB)


def _recipe(tmp_path: Path, spec: str, tokenizer: Path) -> Path:
    data = {
        "sources": [spec],
        "tokenizer": f"hf:{tokenizer}",
        "max_bytes": None,
        "valid_fraction": 0.1,
        "seed": 3,
    }
    recipe = tiny_recipe(tmp_path / "cache", steps=3, document_masking=True, data=data)
    recipe["model"]["vocab_size"] = 512
    return write_recipe(tmp_path / "recipe.yaml", recipe)


def _as_shards(stream, directory: Path, tokenizer):
    """The documents of ``stream`` written as a diffattn shard set (EOS after each)."""
    writer = ShardWriter(
        directory,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        tokenizer_name=tokenizer.name,
    )
    for doc in stream.documents():
        writer.add(doc)
    return writer.close()


def _losses(out: Path) -> list[float]:
    from diffattn.train import read_metrics

    return [r["loss"] for r in read_metrics(out) if "loss" in r]


@pytest.mark.parametrize("kind", ["megatron", "datatrove"])
def test_training_on_token_files_equals_training_on_the_same_tokens_as_shards(
    tmp_path, tokenizer, kind
):
    from diffattn.train import TrainConfig, load_config, train

    docs = documents(20, 400, VOCAB)
    if kind == "megatron":  # EOS in the files (--append-eod)
        spec = f"megatron:{write_megatron(tmp_path / 'm', docs, np.int32, eos=True)}"
    else:  # no EOS in the files: the reader appends one to each document
        spec = f"datatrove:{write_datatrove(tmp_path / 'dt', docs, tokenizer)}"
    recipe = _recipe(tmp_path, spec, tokenizer)
    assert cli.main(["train", str(recipe), "--out", str(tmp_path / "files"), "--quiet"]) == 0
    config = load_config(recipe)
    data = prepare_data(config.data_config(), progress=False)
    assert data.cached and data.stats.valid_documents > 0

    shards = {
        split: _as_shards(getattr(data, split), tmp_path / "shards" / split, data.tokenizer)
        for split in ("train", "valid")
    }
    for split, shard_set in shards.items():
        stream = getattr(data, split)
        assert shard_set.num_tokens == stream.num_tokens
        assert np.array_equal(
            shard_set.read(0, shard_set.num_tokens), stream.read(0, stream.num_tokens)
        )
    size, seq_len = config.global_batch_size, config.seq_len
    from_files = BatchLoader(data.train, size, seq_len, seed=config.seed)
    from_shards = BatchLoader(shards["train"], size, seq_len, seed=config.seed)
    for _ in range(config.steps):
        batch = next(from_files)
        assert torch.equal(batch, next(from_shards))
        assert (batch == EOS).any()  # document masking sees the documents
        assert documents_after_eos(batch, EOS).max() > 0

    prepared = dataclasses.replace(data, train=shards["train"], valid=shards["valid"])
    train(
        TrainConfig.from_dict(config.to_dict()),
        tmp_path / "shards-run",
        progress=False,
        data=prepared,
    )
    expected = _losses(tmp_path / "shards-run")
    assert len(expected) == config.steps
    assert _losses(tmp_path / "files") == expected


def test_a_corrupt_token_file_stops_train_with_one_line(tmp_path, tokenizer, capsys):
    prefix = write_megatron(tmp_path / "m", documents(21, 60, VOCAB), np.uint16)
    bin_path = Path(f"{prefix}.bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-5])
    recipe = _recipe(tmp_path, f"megatron:{prefix}", tokenizer)
    assert cli.main(["train", str(recipe), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bin_path) in err[0] and "truncated" in err[0], err
    assert not (tmp_path / "out").exists()

    folder = write_datatrove(tmp_path / "dt", documents(22, 60, VOCAB), tokenizer)
    index = folder / "00000_unshuffled.ds.index"
    index.unlink()
    recipe = _recipe(tmp_path, f"datatrove:{folder}", tokenizer)
    assert cli.main(["train", str(recipe), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{index}: missing" in err[0], err


def test_a_run_resumes_on_token_files_prepared_again(tmp_path, tokenizer):
    """A new modification time prepares the files again (a new cache entry) with the same
    stream fingerprint, so the loader's checkpointed position is accepted; the resumed run
    continues with the losses of an uninterrupted one."""
    import os

    from diffattn.train import read_metrics

    prefix = write_megatron(tmp_path / "m", documents(23, 400, VOCAB), np.uint16)
    recipe = _recipe(tmp_path, f"megatron:{prefix}", tokenizer)
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    assert cli.main(["train", str(recipe), "--out", whole, "--steps", "4", "--quiet"]) == 0
    every = ["--set", "checkpoint_every=2", "--quiet"]
    assert cli.main(["train", str(recipe), "--out", parts, "--steps", "2", *every]) == 0
    bin_path = Path(f"{prefix}.bin")
    stat = bin_path.stat()
    os.utime(bin_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    resumed = ["--steps", "4", "--resume", *every]
    assert cli.main(["train", str(recipe), "--out", parts, *resumed]) == 0
    assert len(list((tmp_path / "cache" / "shards").iterdir())) == 2
    losses = {r["step"]: r["loss"] for r in read_metrics(parts) if "loss" in r}
    assert losses == {r["step"]: r["loss"] for r in read_metrics(whole) if "loss" in r}
