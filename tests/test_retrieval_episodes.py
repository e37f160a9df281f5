"""Token-level retrieval episodes (diffattn.data.synthetic.RetrievalTask)."""

from __future__ import annotations

import random

import pytest

from diffattn.data.synthetic import (
    BOS,
    IGNORE_INDEX,
    SEP,
    RetrievalTask,
    retrieval_batch,
    retrieval_episode,
    retrieval_test_set,
)

TASK = RetrievalTask(context=48, queries=3, lookalikes=2, filler=5, prefixes=6, suffixes=7,
                     values=11)  # fmt: skip


def ranges(task):
    start = 2
    out = {}
    for kind, size in (("filler", task.filler), ("prefix", task.prefixes),
                       ("suffix", task.suffixes), ("value", task.values)):  # fmt: skip
        out[kind] = range(start, start + size)
        start += size
    assert start == task.vocab_size
    return out


@pytest.mark.parametrize("pairs", [3, 5, 9, 16])
def test_episodes_answer_from_context_with_the_loss_on_answers_only(pairs):
    r = ranges(TASK)
    for seed in range(20):
        e = retrieval_episode(TASK, random.Random(seed), pairs)
        ids, labels = e["input_ids"], e["labels"]
        assert len(ids) == len(labels) == TASK.seq_len
        assert ids[0] == BOS and ids[1 + TASK.context] == SEP
        # the loss mask: exactly the answer positions, one after each query position
        answer_positions = [p + 1 for p in e["query_positions"]]
        assert [i for i, t in enumerate(labels) if t != IGNORE_INDEX] == answer_positions
        context = ids[1 : 1 + TASK.context]
        keys_in_context = []
        for i in range(len(context) - 2):
            if context[i] in r["prefix"]:
                assert context[i + 1] in r["suffix"] and context[i + 2] in r["value"]
                keys_in_context.append((context[i], context[i + 1]))
        assert len(keys_in_context) == pairs == len(set(keys_in_context))  # distinct keys
        assert sum(t in r["filler"] for t in context) == TASK.context - 3 * pairs
        for q, position in enumerate(e["query_positions"]):
            key = (ids[position - 1], ids[position])
            a, b = e["answer_spans"][q]
            assert b - a == 3 and tuple(ids[a : a + 2]) == key  # the queried pair ...
            assert ids[a + 2] == e["answers"][q] == labels[position + 1] == ids[position + 1]
            assert e["answers"][q] in r["value"]  # keys and values from disjoint ranges
            spans = e["lookalike_spans"][q] + e["other_spans"][q]
            assert len(spans) == pairs - 1 and (a, b) not in spans
            for c, _ in e["lookalike_spans"][q]:  # ... its look-alikes share the prefix only
                assert ids[c] == key[0] and ids[c + 1] != key[1]
            for c, _ in e["other_spans"][q]:
                assert ids[c] != key[0]
            want = min(TASK.lookalikes, (pairs - TASK.queries) // TASK.queries)
            assert len(e["lookalike_spans"][q]) >= want
        # queries ask distinct keys
        assert len({tuple(ids[p - 1 : p + 1]) for p in e["query_positions"]}) == TASK.queries


def test_test_episodes_are_fixed_by_their_seed_and_training_draws_the_range():
    one = retrieval_test_set(TASK, [4, 8], 5, seed=3)
    two = retrieval_test_set(TASK, [4, 8], 5, seed=3)
    assert one == two  # the same for every model, whatever ran before
    assert retrieval_test_set(TASK, [4, 8], 5, seed=4)[4].input_ids != one[4].input_ids
    assert one[8].pairs == [8] * 5
    batch = retrieval_batch(TASK, random.Random(0), [3, 4, 5, 6], 200)
    assert set(batch.pairs) == {3, 4, 5, 6}
    assert batch == retrieval_batch(TASK, random.Random(0), [3, 4, 5, 6], 200)


def test_bad_tasks_and_pair_counts_are_refused():
    with pytest.raises(ValueError, match=r"pairs must be in 3\.\.16"):
        retrieval_episode(TASK, random.Random(0), 17)
    with pytest.raises(ValueError, match="pairs must be in"):
        retrieval_episode(TASK, random.Random(0), 2)
    with pytest.raises(ValueError, match="values must be >= 1"):
        RetrievalTask(values=0)
    with pytest.raises(ValueError, match="lookalikes"):
        RetrievalTask(suffixes=2, lookalikes=2)


def _stream_digest(task, seed, pairs, steps, size):
    import hashlib
    import json
    from dataclasses import asdict

    rng = random.Random(f"retrieval-train:{seed}:{task}")
    digest = hashlib.sha256()
    for _ in range(steps):
        digest.update(json.dumps(asdict(retrieval_batch(task, rng, pairs, size))).encode())
    return digest.hexdigest()


@pytest.mark.parametrize(
    ("task", "seed", "pairs", "steps", "size", "expected"),
    [
        (  # diffattn compare's retrieval part: its task, train pairs and batch, seed 0
            RetrievalTask(context=32),
            0,
            list(range(4, 11)),
            40,
            32,
            "c7bdfdb893163f322ac96672d4dd7f91d1f440ff6d34253bbc80cba32a7b9105",
        ),
        (
            RetrievalTask(context=64, lookalikes=3, filler=5, prefixes=6, suffixes=9, values=11),
            3,
            [4, 5, 9, 21],
            40,
            7,
            "ff08bcf8db0bab1d51243c07169e7cdb69f05f87a197848c17410b7ebe142485",
        ),
        (
            RetrievalTask(),
            1,
            6,
            20,
            5,
            "dc0ae90dc44d88f2f37c207acc17d64decffc9cadfcf73747ac3967db34d1f43",
        ),
    ],
)
def test_a_seed_gives_the_same_episodes_in_every_version(task, seed, pairs, steps, size, expected):
    """The draws of a seeded stream are a contract: the digests were taken before the
    generator was rewritten for speed, so a change of any episode, span or draw order fails."""
    assert _stream_digest(task, seed, pairs, steps, size) == expected


def test_offsets_are_the_first_token_of_each_range():
    task = RetrievalTask(filler=5, prefixes=6, suffixes=9, values=11)
    kinds = ("filler", "prefix", "suffix", "value")
    assert task.offsets() == tuple(task.token(kind, 0) for kind in kinds)
