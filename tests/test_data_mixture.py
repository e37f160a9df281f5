"""Weighted mixtures: each source's share of the training tokens, the cache key, bad weights,
and plain source lists prepared exactly as before (pinned)."""

from __future__ import annotations

import json

import pytest

from extras import require_extra

pytestmark = require_extra("train")

import numpy as np

from diffattn.data import DataConfig, prepare_data
from diffattn.data.mixture import plan_mixture

RECALL = "synthetic:recall?docs=60"
NEEDLE = "synthetic:needle?docs=12&words=60"


def _config(tmp_path, sources, **changes):
    fields = dict(
        sources=sources, tokenizer="bpe:300", valid_fraction=0.2, cache_dir=str(tmp_path / "cache")
    )
    return DataConfig(**{**fields, **changes})


@pytest.mark.extra("tiktoken")
def test_a_plain_source_list_keeps_its_cache_key_and_fingerprint(tmp_path):
    """Pinned from the code before mixtures existed: the cache entry's name, the token
    fingerprint and the source fingerprint of an unweighted preparation."""
    config = _config(
        tmp_path, [RECALL.replace("60", "40")], tokenizer="tiktoken:cl100k_base", shard_tokens=500
    )
    data = prepare_data(config, progress=False)
    assert data.directory.name == "41cd370bbee17dabca556417"
    assert data.stats.fingerprint == (
        "49ca4b01fccc9922785e462381a7ce061c7e863b9b8295da794ad2a751ee694e"
    )
    assert data.stats.source_fingerprint == (
        "aa4b8c794d1807d1a542133a25213d59f137028f51a3cb014263768112a1dee4"
    )
    assert (data.stats.documents, data.stats.tokens) == (40, 2846)
    record = json.loads((data.directory / "prepared.json").read_text())
    assert list(record) == ["format", "version", "config", "stats"]
    assert record["config"]["sources"] == [RECALL.replace("60", "40")]
    assert "weights" not in record["config"]


def _shares(data):
    record = json.loads((data.directory / "prepared.json").read_text())["mixture"]
    return {s["source"]: s for s in record["sources"]}


def test_weights_set_each_sources_share_of_the_training_tokens(tmp_path):
    weighted = [{"source": RECALL, "weight": 3}, {"source": NEEDLE, "weight": 1}]
    data = prepare_data(_config(tmp_path, weighted), progress=False)
    shares = _shares(data)
    natural = sum(s["natural_tokens"] for s in shares.values())
    longest = max(len(d) + 1 for d in data.train.documents())
    for source, target in ((RECALL, 0.75), (NEEDLE, 0.25)):
        entry = shares[source]
        assert entry["target_share"] == target
        # the budget is the corpus's own size; a source overshoots by less than one document
        assert target * natural <= entry["tokens"] < target * natural + longest
        assert abs(entry["share"] - target) < longest / natural
    assert shares[NEEDLE]["copies"] < 1 < shares[RECALL]["copies"]  # subsampled / repeated
    assert data.stats.train_tokens == sum(s["tokens"] for s in shares.values())
    # nothing of the per-source step is left in the cache entry
    assert sorted(p.name for p in data.directory.iterdir()) == [
        "prepared.json",
        "tokenizer",
        "train",
        "valid",
    ]


def test_repeated_documents_never_cross_into_validation(tmp_path):
    weighted = [{"source": RECALL, "weight": 5}, {"source": NEEDLE, "weight": 1}]
    data = prepare_data(_config(tmp_path, weighted), progress=False)
    train = {tuple(d.tolist()) for d in data.train.documents()}
    valid = {tuple(d.tolist()) for d in data.valid.documents()}
    assert valid and not train & valid
    plain = prepare_data(_config(tmp_path, [RECALL, NEEDLE]), progress=False)
    assert valid == {tuple(d.tolist()) for d in plain.valid.documents()}  # each once


def test_weights_are_part_of_the_cache_key_and_both_spellings_agree(tmp_path):
    mapped = _config(
        tmp_path, [{"source": RECALL, "weight": 0.7}, {"source": NEEDLE, "weight": 0.3}]
    )
    listed = _config(tmp_path, [RECALL, NEEDLE], weights=[0.7, 0.3])
    assert mapped == listed and mapped.to_dict() == listed.to_dict()
    assert DataConfig.from_dict(mapped.to_dict()) == mapped
    first = prepare_data(mapped, progress=False)
    again = prepare_data(listed, progress=False)
    assert again.cached and again.directory == first.directory
    other = prepare_data(_config(tmp_path, [RECALL, NEEDLE], weights=[0.5, 0.5]), progress=False)
    plain = prepare_data(_config(tmp_path, [RECALL, NEEDLE]), progress=False)
    names = {first.directory.name, other.directory.name, plain.directory.name}
    assert len(names) == 3
    fingerprints = {first.stats.fingerprint, other.stats.fingerprint, plain.stats.fingerprint}
    assert len(fingerprints) == 3


@pytest.mark.parametrize("weight", [0, -1, float("nan"), float("inf"), "0.5", True, None])
def test_a_weight_that_is_not_a_positive_finite_number_names_the_source(tmp_path, weight):
    with pytest.raises(ValueError) as info:
        _config(tmp_path, [{"source": RECALL, "weight": 1}, {"source": NEEDLE, "weight": weight}])
    message = str(info.value)
    assert "\n" not in message and NEEDLE in message and "positive finite" in message


def test_a_mixture_needs_a_weight_for_every_source(tmp_path):
    with pytest.raises(ValueError, match=r"source 'stdlib' has no weight"):
        _config(tmp_path, [{"source": RECALL, "weight": 1}, "stdlib"])
    with pytest.raises(ValueError, match=r"1 weight\(s\) for 2 source\(s\)"):
        _config(tmp_path, [RECALL, NEEDLE], weights=[1])
    with pytest.raises(ValueError, match="bad mixture entry"):
        _config(tmp_path, [{"source": RECALL, "weight": 1, "sheet": 2}])


def test_a_mixture_source_without_training_documents_is_named(tmp_path):
    config = _config(tmp_path, [RECALL, "stdlib"], weights=[1, 1], max_bytes=2000)
    with pytest.raises(ValueError, match=r"mixture source 'stdlib' has no training documents"):
        prepare_data(config, progress=False)
    assert not list((tmp_path / "cache" / "shards").glob("*/prepared.json"))


def test_plan_is_exact_for_equal_documents_and_seeded():
    lengths = [[10] * 40, [10] * 10]  # 500 tokens, 100-token budget steps
    plan = plan_mixture(lengths, [1, 1], seed=3)
    counts = np.bincount([s for s, _ in plan], minlength=2)
    assert counts.tolist() == [25, 25]  # half the 500 tokens each: source 1 four times over
    copies = np.bincount([d for s, d in plan if s == 1], minlength=10)
    assert set(copies.tolist()) <= {2, 3}  # whole passes, then part of one more
    assert plan == plan_mixture(lengths, [1, 1], seed=3)
    assert plan != plan_mixture(lengths, [1, 1], seed=4)
    assert sorted(plan_mixture(lengths, [2, 2], seed=3)) == sorted(plan)  # only ratios count


def test_weights_on_token_file_sources_are_refused(tmp_path, monkeypatch):
    """megatron:/datatrove: sources are read in place, each document once: weights on them are
    refused rather than ignored (the dispatch is stood in for; no token files needed)."""
    from diffattn.data import prepare as prepare_module

    monkeypatch.setattr(prepare_module, "token_sources", lambda specs: True)
    config = _config(tmp_path, [RECALL, NEEDLE], weights=[1, 1])
    with pytest.raises(ValueError, match="mixture weights apply to text sources"):
        prepare_data(config, progress=False)
    plain = _config(tmp_path, [RECALL, NEEDLE])
    monkeypatch.setattr(prepare_module, "_prepare_token_files", lambda config, progress: "read")
    assert prepare_data(plain, progress=False) == "read"


def test_replace_weighs_these_sources_or_drops_the_weights_with_new_sources(tmp_path):
    plain = _config(tmp_path, [RECALL, NEEDLE])
    mixture = plain.replace(weights=[2, 1])
    assert mixture.sources == plain.sources and mixture.weights == (2.0, 1.0)
    assert mixture.replace(weights=None) == plain
    assert mixture.replace(sources=[RECALL]).weights is None
    assert mixture.replace(seed=3).weights == (2.0, 1.0)
