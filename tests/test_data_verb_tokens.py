"""``diffattn data prepare|inspect`` on ``megatron:`` token files, which are read in place: the
summary says so, and inspect decodes their documents as written."""

from __future__ import annotations

import json

from extras import require_extra

pytestmark = require_extra("formats", "train", "hf")

import numpy as np

from diffattn.cli import main
from test_data_external import documents, word_tokenizer, write_megatron


def test_prepare_and_inspect_token_files(tmp_path, capsys):
    tokenizer = word_tokenizer(tmp_path / "tokenizer", 1000)
    docs = documents(seed=1, count=30, high=1000)
    prefix = write_megatron(tmp_path / "corpus", docs, np.uint16)
    cache = str(tmp_path / "cache")
    argv = ["data", "prepare", "--source", f"megatron:{prefix}", "--tokenizer", f"hf:{tokenizer}"]
    assert main([*argv, "--valid-fraction", "0", "--cache-dir", cache, "--quiet"]) == 0
    out = capsys.readouterr().out
    tokens = sum(len(d) + 1 for d in docs)
    assert f"  train        30 documents, {tokens:,} tokens, token files read in place" in out
    (directory,) = (tmp_path / "cache" / "shards").iterdir()
    assert main(["data", "inspect", str(directory), "--json", "--samples", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    train = summary["splits"]["train"]
    assert (train["documents"], train["tokens"], train["shards"]) == (30, tokens, [])
    expected = [" ".join(f"w{k}" for k in docs[i]) for i in (0, 15)]
    assert [s["text"] for s in train["samples"]] == expected
