"""``diffattn data prepare|inspect``: the train cache key, the printed totals, inspection, and
bad input (one line, exit code 2, nothing written or read half-way)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from diffattn.cli import main
from diffattn.data import DataConfig, prepare_data
from diffattn.fileio import TEMP_MARKER
from extras import require_extra

pytestmark = require_extra("train")

import yaml

from train_helpers import tiny_recipe


def _corpus(tmp_path, n=30):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(n):
        (root / f"d{i:02d}.txt").write_text(f"document {i} about alpha beta gamma {i * 7} words\n")
    return root


def _flags(tmp_path, *more, corpus=None):
    """``data prepare`` of the corpus under ``tmp_path`` (made when not given) by flags."""
    corpus = _corpus(tmp_path) if corpus is None else corpus
    return [
        "data",
        "prepare",
        "--source",
        str(corpus),
        "--tokenizer",
        "bpe:300",
        "--valid-fraction",
        "0.2",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--quiet",
        *more,
    ]


def _run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(capsys, argv, *named):
    code, out, err = _run(capsys, argv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffattn data: error: "), err
    for text in named:
        assert str(text) in lines[0], lines[0]
    return lines[0]


def _entries(tmp_path):
    return sorted(p.name for p in (tmp_path / "cache" / "shards").iterdir())


def test_prepare_from_flags_is_prepare_data_and_prints_where_and_totals(tmp_path, capsys):
    argv = _flags(tmp_path)
    code, out, err = _run(capsys, argv)
    assert code == 0, err
    config = DataConfig(
        sources=[str(tmp_path / "corpus")],
        tokenizer="bpe:300",
        valid_fraction=0.2,
        cache_dir=str(tmp_path / "cache"),
    )
    data = prepare_data(config, progress=False)
    assert data.cached  # the command prepared this very entry
    assert out.startswith("diffattn data: prepared in ")
    assert f"prepared data: {data.directory}\n" in out
    assert f"train        {data.stats.train_documents:,} documents, " in out
    assert f"{data.stats.valid_tokens:,} tokens" in out
    assert data.stats.fingerprint in out and "bpe:300 (vocab 300, EOS 0)" in out
    assert err == ""  # --quiet: no progress bar
    code, out, _ = _run(capsys, argv)
    assert code == 0 and out.startswith("diffattn data: found in the cache")


def _recipe(tmp_path, corpus, **data):
    """The trainer tests' tiny recipe, 2 steps on ``corpus`` with a 300-token BPE."""
    recipe = tiny_recipe(
        tmp_path / "cache",
        model={"vocab_size": 320, "n_layers": 1, "max_seq_len": 32},
        data={"sources": [str(corpus)], "tokenizer": "bpe:300", "max_bytes": None, **data},
        schedule={"warmup_steps": 1, "total_steps": 4},
        steps=2,
        global_batch_size=4,
        micro_batch_size=None,
        seq_len=16,
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.extra("hf")
@pytest.mark.usefixtures("one_thread")
def test_train_of_the_prepared_recipe_tokenises_nothing(tmp_path, capsys, monkeypatch):
    from tokenizers import trainers as hf_trainers

    from diffattn.data import prepare as prepare_module

    recipe = _recipe(tmp_path, _corpus(tmp_path))
    argv = ["data", "prepare", str(recipe), "--set", "data.valid_fraction=0.25", "--quiet"]
    code, out, err = _run(capsys, argv)
    assert code == 0, err
    entries = _entries(tmp_path)
    assert len(entries) == 1 and entries[0] in out
    listing = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*")}

    def no_tokenising(*args, **kwargs):
        raise AssertionError("train tokenised again")

    monkeypatch.setattr(prepare_module, "write_token_shards", no_tokenising)
    monkeypatch.setattr(prepare_module, "write_mixture_shards", no_tokenising)
    monkeypatch.setattr(hf_trainers, "BpeTrainer", no_tokenising)  # learning a BPE
    argv = [
        "train", str(recipe), "--set", "data.valid_fraction=0.25", "--out", str(tmp_path / "run"),
        "--quiet",
    ]  # fmt: skip
    code, out, err = _run(capsys, argv)
    assert code == 0, err
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*")} == listing
    # the guard bites: another validation split is a new entry, which needs tokenising
    argv[3], argv[5] = "data.valid_fraction=0.3", str(tmp_path / "run2")
    with pytest.raises(AssertionError, match="train tokenised again"):
        main(argv)


def test_inspect_shows_totals_shards_and_decoded_samples(tmp_path, capsys):
    assert _run(capsys, _flags(tmp_path))[0] == 0
    (directory,) = (tmp_path / "cache" / "shards").iterdir()
    code, out, err = _run(capsys, ["data", "inspect", str(directory), "--json", "--samples", "2"])
    assert code == 0, err
    summary = json.loads(out)
    record = json.loads((directory / "prepared.json").read_text())
    stats = record["stats"]
    assert summary["kind"] == "prepared"
    assert summary["tokenizer"] == {"name": "bpe:300", "vocab_size": 300, "eos_id": 0}
    assert summary["fingerprint"] == stats["fingerprint"]
    assert summary["documents"] == stats["documents"] == 30
    train, valid = summary["splits"]["train"], summary["splits"]["valid"]
    assert (train["documents"], train["tokens"]) == (
        stats["train_documents"],
        stats["train_tokens"],
    )
    assert (valid["documents"], valid["tokens"]) == (
        stats["valid_documents"],
        stats["valid_tokens"],
    )
    assert train["shards"] == [
        {
            "file": "train/shard-00000.bin",
            "tokens": train["tokens"],
            "documents": train["documents"],
            "bytes": (directory / "train" / "shard-00000.bin").stat().st_size,
        }
    ]
    texts = {p.read_text() for p in (tmp_path / "corpus").iterdir()}
    assert len(train["samples"]) == 2 and train["samples"][0]["document"] == 0
    assert all(s["text"] in texts for s in train["samples"] + valid["samples"])
    code, out, _ = _run(capsys, ["data", "inspect", str(directory / "valid"), "--samples", "1"])
    assert code == 0 and out.startswith(f"shard set: {directory / 'valid'}\n")
    assert "  shard-00000.bin " in out and out.count("valid #") == 1


def test_inspect_finds_a_recipes_prepared_data_or_says_to_prepare(tmp_path, capsys):
    recipe = _recipe(tmp_path, _corpus(tmp_path))
    line = _one_error(capsys, ["data", "inspect", str(recipe)], "no prepared data")
    assert "diffattn data prepare" in line
    assert _run(capsys, ["data", "prepare", str(recipe), "--quiet"])[0] == 0
    code, out, _ = _run(capsys, ["data", "inspect", str(recipe), "--samples", "0"])
    (directory,) = (tmp_path / "cache" / "shards").iterdir()
    assert code == 0 and out.startswith(f"prepared data: {directory}\n")


def _prepared(tmp_path, capsys):
    assert _run(capsys, _flags(tmp_path))[0] == 0
    (directory,) = (tmp_path / "cache" / "shards").iterdir()
    return directory


def test_a_truncated_shard_is_one_line_naming_it(tmp_path, capsys):
    directory = _prepared(tmp_path, capsys)
    shard = directory / "train" / "shard-00000.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-5])
    _one_error(capsys, ["data", "inspect", str(directory)], shard, "truncated")
    assert shard.read_bytes() == data[:-5]  # nothing repaired or rewritten


@pytest.mark.parametrize("name", ["train/manifest.json", "prepared.json"])
@pytest.mark.parametrize("garble", ["junk", "valid JSON, wrong shape"])
def test_a_garbled_manifest_or_record_is_one_line_naming_it(tmp_path, capsys, name, garble):
    directory = _prepared(tmp_path, capsys)
    path = directory / name
    if garble == "junk":
        path.write_bytes(path.read_bytes()[:40] + b"\x00garbled")
    else:
        record = json.loads(path.read_text())
        record.pop("shards" if name.startswith("train") else "stats")
        path.write_text(json.dumps(record))
    _one_error(capsys, ["data", "inspect", str(directory)], path)


def test_a_killed_preparation_is_never_read(tmp_path, capsys):
    """A preparation killed half-way (SIGKILL-like: no clean-up) leaves only a temporary
    directory; the next prepare does the work again and inspect refuses the leftover."""
    corpus = _corpus(tmp_path)
    script = textwrap.dedent(
        f"""
        import os
        from diffattn.data import shards
        from diffattn.data import DataConfig, prepare_data

        close = shards.ShardWriter.close
        def die_after_train(self):
            result = close(self)
            if self.directory.name == "train":
                os._exit(9)
            return result
        shards.ShardWriter.close = die_after_train
        prepare_data(DataConfig(sources=[{str(corpus)!r}], tokenizer="bpe:300",
                     valid_fraction=0.2, cache_dir={str(tmp_path / "cache")!r}), progress=False)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 9, done.stderr
    (leftover,) = (tmp_path / "cache" / "shards").iterdir()
    assert TEMP_MARKER in leftover.name and (leftover / "train" / "manifest.json").is_file()
    _one_error(capsys, ["data", "inspect", str(leftover)], leftover, "interrupted")
    code, out, err = _run(capsys, _flags(tmp_path, corpus=corpus))
    assert code == 0 and out.startswith("diffattn data: prepared in "), err
    complete = [p for p in (tmp_path / "cache" / "shards").iterdir() if p != leftover]
    assert len(complete) == 1 and (complete[0] / "prepared.json").is_file()


@pytest.mark.parametrize("weight", ["0", "-1", "nan", "inf"])
def test_a_bad_weight_is_one_line_naming_the_source(tmp_path, capsys, weight):
    argv = _flags(tmp_path, "--weight", "1", weight)
    argv[3:4] = [argv[3], "stdlib"]
    _one_error(capsys, argv, "mixture weight of source 'stdlib'", "positive finite")
    assert not (tmp_path / "cache").exists()


def test_weights_need_one_per_source(tmp_path, capsys):
    _one_error(capsys, _flags(tmp_path, "--weight", "1", "2"), "2 weight(s) for 1 source(s)")


def test_a_corrupt_file_among_many_names_file_and_offset_in_strict_mode(tmp_path, capsys):
    corpus = _corpus(tmp_path, n=12)
    bad = corpus / "d05.txt"
    bad.write_bytes(b"fine text, then caf\xe9 latin-1\n")
    argv = _flags(tmp_path, "--strict", corpus=corpus)
    _one_error(capsys, argv, f"{bad}: byte 19: not valid UTF-8 (byte 0xe9)")
    assert not list((tmp_path / "cache").rglob("prepared.json"))  # nothing cached
    code, _, err = _run(capsys, argv[:-1])  # without --strict: replaced and counted
    assert code == 0 and "replaced 1 invalid UTF-8 byte(s)" in err


def test_overrides_and_weights_without_what_they_apply_to(tmp_path, capsys):
    _one_error(capsys, ["data", "prepare", "--set", "data.seed=1"], "give the recipe")
    _one_error(capsys, ["data", "prepare", "--weight", "1"], "--weight needs --source")
    _one_error(capsys, ["data", "inspect", str(tmp_path / "nothing.yaml")], "nothing.yaml")


def test_verify_rehashes_what_the_size_check_passes(tmp_path, capsys):
    directory = _prepared(tmp_path, capsys)
    shard = directory / "valid" / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[70] ^= 0x01  # a token changed, the size kept
    shard.write_bytes(bytes(data))
    assert _run(capsys, ["data", "inspect", str(directory), "--samples", "0"])[0] == 0
    _one_error(capsys, ["data", "inspect", str(directory), "--verify"], shard, "sha256 mismatch")


def test_flags_override_the_recipe_and_weights_apply_to_its_sources(tmp_path):
    from diffattn.commands.data import PrepareSettings, data_config

    corpus = _corpus(tmp_path)
    recipe = _recipe(tmp_path, corpus, sources=[str(corpus), "stdlib"])
    plain = data_config(PrepareSettings(recipe=str(recipe)))
    assert plain.sources == (str(corpus), "stdlib") and plain.weights is None
    weighted = data_config(PrepareSettings(recipe=str(recipe), weights=(3.0, 1.0), seed=4))
    assert weighted.sources == plain.sources and weighted.weights == (3.0, 1.0)
    assert weighted.replace(weights=None, seed=0) == plain
    mixed = data_config(
        PrepareSettings(recipe=str(recipe), overrides=("data.weights=[1,2]",), sources=("a",))
    )
    assert mixed.sources == ("a",) and mixed.weights is None  # new sources drop the old weights


@pytest.mark.parametrize("verb", ["data prepare", "train"])
def test_a_bad_weight_in_a_recipe_is_one_line_for_prepare_and_train(tmp_path, capsys, verb):
    corpus = _corpus(tmp_path)
    weighted = [{"source": str(corpus), "weight": 1}, {"source": "stdlib", "weight": float("nan")}]
    recipe = _recipe(tmp_path, corpus, sources=weighted)
    argv = [*verb.split(), str(recipe)]
    if verb == "train":
        argv += ["--out", str(tmp_path / "run")]
    code, out, err = _run(capsys, argv)
    assert code == 2 and out == ""
    assert err == (
        f"diffattn {verb.split()[0]}: error: data.sources: mixture weight of source 'stdlib' "
        "must be a positive finite number, got nan\n"
    )
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
