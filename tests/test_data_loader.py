"""BatchLoader: determinism, epochs, exact resume, rank slices; eval_batches."""

from __future__ import annotations

import itertools

from extras import require_extra

pytestmark = require_extra("train")

import numpy as np
import pytest
import torch

from diffattn.data import BatchLoader, ShardWriter, eval_batches
from diffattn.data.loader import spread_windows

VOCAB = 5000


@pytest.fixture
def shards(tmp_path):
    """A shard set whose token at stream position p is 1 + p % (VOCAB - 1), EOS excepted."""
    writer = ShardWriter(
        tmp_path / "set", vocab_size=VOCAB, eos_id=0, tokenizer_name="t", shard_tokens=1000
    )
    position = 0
    rng = np.random.default_rng(0)
    for _ in range(60):
        length = int(rng.integers(20, 120))
        writer.add([1 + (p % (VOCAB - 1)) for p in range(position, position + length)])
        position += length + 1
    return writer.close()


def _take(loader, n):
    return [batch.clone() for batch in itertools.islice(loader, n)]


def test_shapes_dtype_and_windows_are_contiguous(shards):
    loader = BatchLoader(shards, batch_size=4, seq_len=16, seed=0)
    batch = next(loader)
    assert batch.shape == (4, 16) and batch.dtype == torch.long
    stream = shards.read(0, shards.num_tokens)
    windows = loader.global_windows(0, 0)
    for row, window in zip(batch, windows, strict=True):
        assert row.tolist() == stream[window * 16 : (window + 1) * 16].tolist()
    assert len(shards.shards) > 1  # windows cross shard files


def test_deterministic_by_seed_and_epochs_roll_over(shards):
    a = _take(BatchLoader(shards, 8, 32, seed=1), 30)
    b = _take(BatchLoader(shards, 8, 32, seed=1), 30)
    c = _take(BatchLoader(shards, 8, 32, seed=2), 30)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    loader = BatchLoader(shards, 8, 32, seed=1)
    steps = len(loader)
    assert steps == (shards.num_tokens // 32) // 8
    _take(loader, steps)
    assert loader.epoch == 0
    next(loader)
    assert loader.epoch == 1 and loader.index == 1
    # Within an epoch no window repeats; epochs use different orders.
    first = np.concatenate([loader.global_windows(0, i) for i in range(steps)])
    assert len(set(first.tolist())) == len(first)
    assert not np.array_equal(loader.window_order(0), loader.window_order(1))


def test_exact_resume_from_state_dict(shards):
    steps = len(BatchLoader(shards, 4, 24))
    total = 2 * steps + 3  # crosses two epoch boundaries
    reference = _take(BatchLoader(shards, 4, 24, seed=7), total)
    for stop in (0, 5, steps - 1, steps, steps + 1, total - 1):
        loader = BatchLoader(shards, 4, 24, seed=7)
        _take(loader, stop)
        state = loader.state_dict()
        resumed = BatchLoader(shards, 4, 24, seed=7)
        resumed.load_state_dict(state)
        assert (resumed.epoch, resumed.index) == (loader.epoch, loader.index)
        rest = _take(resumed, total - stop)
        assert all(torch.equal(x, y) for x, y in zip(rest, reference[stop:], strict=True))


def test_state_from_other_data_or_settings_is_refused(shards, tmp_path):
    state = BatchLoader(shards, 4, 24, seed=7).state_dict()
    writer = ShardWriter(tmp_path / "other", vocab_size=VOCAB, eos_id=0, tokenizer_name="t")
    for i in range(50):
        writer.add(list(range(1, 40 + i % 3)))
    other = writer.close()
    with pytest.raises(ValueError, match="different data"):
        BatchLoader(other, 4, 24, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        BatchLoader(shards, 4, 16, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        BatchLoader(shards, 4, 24, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="not a version-1 BatchLoader state"):
        BatchLoader(shards, 4, 24, seed=7).load_state_dict({"epoch": 0})
    # The world size may change across a resume.
    BatchLoader(shards, 4, 24, seed=7, rank=1, world_size=2).load_state_dict(state)


def test_rank_slices_reassemble_the_global_batch(shards):
    single = _take(BatchLoader(shards, 8, 16, seed=3), 25)
    ranks = [_take(BatchLoader(shards, 8, 16, seed=3, rank=r, world_size=2), 25) for r in (0, 1)]
    for step, batch in enumerate(single):
        assert ranks[0][step].shape == (4, 16)
        assert torch.equal(torch.cat([ranks[0][step], ranks[1][step]]), batch)


def test_bad_arguments(shards):
    with pytest.raises(ValueError, match="not divisible by world_size 3"):
        BatchLoader(shards, 8, 16, world_size=3)
    with pytest.raises(ValueError, match="rank"):
        BatchLoader(shards, 8, 16, rank=2, world_size=2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        BatchLoader(shards, 10_000, 16)
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        BatchLoader(shards, 8, 0)


def test_eval_batches_are_fixed_and_unshuffled(shards):
    seq = 32
    windows = shards.num_tokens // seq
    batches = list(eval_batches(shards, 16, seq))
    assert sum(b.shape[0] for b in batches) == windows  # last batch is partial
    flat = torch.cat(batches).reshape(-1)
    assert flat.tolist() == shards.read(0, windows * seq).tolist()
    again = list(eval_batches(shards, 16, seq))
    assert all(torch.equal(x, y) for x, y in zip(batches, again, strict=True))
    assert len(list(eval_batches(shards, 16, seq, max_batches=2))) == 2
    full = list(eval_batches(shards, 16, seq, drop_last=True))
    assert all(b.shape[0] == 16 for b in full)
    # several ranks drop the partial batch, so they split the windows of the drop_last listing
    halves = [list(eval_batches(shards, 16, seq, rank=r, world_size=2)) for r in (0, 1)]
    assert len(halves[0]) == len(full)
    for i, (a, b) in enumerate(zip(*halves, strict=True)):
        assert torch.equal(torch.cat([a, b]), full[i])
    with pytest.raises(ValueError, match="do not fill one window"):
        list(eval_batches(shards, 1, shards.num_tokens + 1))


def test_spread_windows_cover_the_stream_evenly():
    assert spread_windows(10, 4).tolist() == [0, 2, 5, 7]
    assert spread_windows(7, 7).tolist() == list(range(7))
    assert spread_windows(7, 100).tolist() == list(range(7))  # never more than exist
    assert spread_windows(1, 1).tolist() == [0]
    for n, k in [(129, 16), (1000, 7), (16, 15)]:
        picked = spread_windows(n, k)
        assert len(picked) == k and len(set(picked.tolist())) == k
        assert picked[0] == 0 and picked[-1] >= n - n // k - 1
        gaps = np.diff(picked)
        assert gaps.min() >= n // k and gaps.max() <= -(-n // k)  # as even as integers allow
    with pytest.raises(ValueError, match="count must be a positive integer"):
        spread_windows(10, 0)
    with pytest.raises(ValueError, match="num_windows must be a positive integer"):
        spread_windows(0, 3)


def test_capped_eval_batches_are_spread_over_the_whole_stream(shards):
    seq, size = 32, 4
    windows = shards.num_tokens // seq
    batches = list(eval_batches(shards, size, seq, max_batches=3))
    assert [b.shape[0] for b in batches] == [size] * 3
    expected = spread_windows(windows, 3 * size)
    assert expected[-1] > windows * 3 // 4  # the tail of the stream is read
    for row, window in zip(torch.cat(batches), expected.tolist(), strict=True):
        assert row.tolist() == shards.read(window * seq, seq).tolist()
    first = torch.cat(list(eval_batches(shards, size, seq, max_batches=3, spread=False)))
    assert first.reshape(-1).tolist() == shards.read(0, 3 * size * seq).tolist()
    # ranks split every batch of the same windows
    halves = [list(eval_batches(shards, size, seq, 3, rank=r, world_size=2)) for r in (0, 1)]
    for i, (a, b) in enumerate(zip(*halves, strict=True)):
        assert torch.equal(torch.cat([a, b]), batches[i])


def test_spread_validation_follows_the_mix_of_a_concatenated_stream(tmp_path):
    """Two sources one after the other (as a prepared mix's held-out split is written): the
    first windows see only the first source, spread windows see both in proportion."""
    writer = ShardWriter(
        tmp_path / "mix", vocab_size=VOCAB, eos_id=0, tokenizer_name="t", shard_tokens=500
    )
    for token, docs in ((1, 30), (2, 10)):  # 3:1 by tokens
        for _ in range(docs):
            writer.add([token] * 99)
    mix = writer.close()
    seq, size, batches = 25, 8, 2

    def share_of_second(spread):
        rows = torch.cat(list(eval_batches(mix, size, seq, batches, spread=spread)))
        return float((rows == 2).sum() / (rows != 0).sum())

    assert share_of_second(spread=False) == 0.0
    assert share_of_second(spread=True) == pytest.approx(0.25, abs=1 / (size * batches))
