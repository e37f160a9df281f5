"""Generation: sampling, caches, padding, EOS, streaming, torch.compile and the CLI verb."""

from __future__ import annotations

import argparse
import math
import sys

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from diffattn import DiffTransformerLM, presets
from diffattn.cache import StaticCache
from diffattn.checkpoint import CheckpointError, save_model
from diffattn.generation import (
    GenerationConfig,
    apply_temperature,
    compiled_decode_step,
    decode_step,
    decoding_plan,
    generate,
    top_k_filter,
    top_p_filter,
)
from extras import require_extra

pytestmark = require_extra("hf")

TYPES = ["baseline", "diff_v1", "diff_v2"]
VOCAB = 256


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest (and steadily on a busy machine) on one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(attention: str, vocab_size: int = VOCAB, **overrides) -> DiffTransformerLM:
    fields = dict(
        attention=attention, d_model=64, n_layers=2, n_heads=4, head_dim=None, max_seq_len=64
    )
    config = presets.get("tiny", vocab_size=vocab_size, **{**fields, **overrides})
    model = DiffTransformerLM(config).eval()
    with torch.no_grad():  # larger, varied weights: logits with clear winners, varied tokens
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _argmax_loop(model, ids, mask, steps):
    """Greedy decoding with a full forward per token (no cache): the reference."""
    with torch.no_grad():
        for _ in range(steps):
            logits = model(ids, attention_mask=mask).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ----------------------------------------------------------------------------------------
# greedy decoding: caches against full forwards
@pytest.mark.parametrize("attention", TYPES)
def test_greedy_dynamic_static_and_no_cache_agree(attention):
    model = _model(attention)
    ids = torch.randint(0, VOCAB, (2, 5))
    expected = _argmax_loop(model, ids, None, 8)
    dynamic = generate(model, ids, max_new_tokens=8, do_sample=False)
    static = generate(model, ids, max_new_tokens=8, temperature=0, cache="static")
    assert torch.equal(dynamic.sequences, expected)
    assert torch.equal(static.sequences, expected)
    assert dynamic.num_new_tokens == 8 and dynamic.new_tokens.shape == (2, 8)
    assert len(set(expected[:, 5:].flatten().tolist())) > 2  # a non-trivial continuation


@pytest.mark.parametrize("attention", TYPES)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_left_padded_batch_equals_each_row_alone(attention, cache):
    model = _model(attention)
    long, short = torch.randint(0, VOCAB, (6,)), torch.randint(0, VOCAB, (3,))
    ids = torch.stack([long, torch.cat([torch.zeros(3, dtype=torch.long), short])])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    batch = generate(model, ids, mask, max_new_tokens=6, do_sample=False, cache=cache)
    for row, prompt in enumerate((long, short)):
        alone = generate(model, prompt[None], max_new_tokens=6, do_sample=False, cache=cache)
        assert torch.equal(batch.new_tokens[row], alone.new_tokens[0])
    assert torch.equal(batch.sequences, _argmax_loop(model, ids, mask, 6))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_chunked_prefill_gives_the_same_tokens(cache):
    model = _model("diff_v1")
    ids = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    whole = generate(model, ids, mask, max_new_tokens=5, do_sample=False, cache=cache)
    chunked = generate(
        model, ids, mask, max_new_tokens=5, do_sample=False, cache=cache, prefill_chunk_size=4
    )
    assert torch.equal(whole.sequences, chunked.sequences)


# ----------------------------------------------------------------------------------------
# sampling
def test_seeded_sampling_is_reproducible_and_seeds_differ():
    model = _model("diff_v2")
    ids = torch.randint(0, VOCAB, (2, 4))
    first = generate(model, ids, max_new_tokens=12, seed=1)
    again = generate(model, ids, max_new_tokens=12, seed=1, cache="static")
    other = generate(model, ids, max_new_tokens=12, seed=2)
    assert torch.equal(first.sequences, again.sequences)
    assert not torch.equal(first.sequences, other.sequences)
    # An explicit generator wins over the seed and is equally reproducible.
    gen = torch.Generator().manual_seed(1)
    assert torch.equal(
        generate(model, ids, max_new_tokens=12, generator=gen).sequences, first.sequences
    )


def test_sampling_is_not_greedy_at_high_temperature():
    model = _model("baseline")
    ids = torch.randint(0, VOCAB, (4, 4))
    greedy = generate(model, ids, max_new_tokens=10, do_sample=False)
    hot = generate(model, ids, max_new_tokens=10, temperature=5.0, seed=0)
    assert not torch.equal(greedy.sequences, hot.sequences)


@pytest.mark.parametrize("settings", [{"top_k": 1}, {"top_p": 1e-9}, {"top_k": 1, "top_p": 0.5}])
def test_top_k_one_and_tiny_top_p_are_greedy(settings):
    model = _model("diff_v1")
    ids = torch.randint(0, VOCAB, (3, 5))
    greedy = generate(model, ids, max_new_tokens=8, do_sample=False)
    sampled = generate(model, ids, max_new_tokens=8, temperature=1.7, seed=3, **settings)
    assert torch.equal(sampled.sequences, greedy.sequences)


def test_logit_filters_against_hand_computed_examples():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.0, 1.0]])
    inf = float("-inf")
    assert torch.equal(
        top_k_filter(logits, 2), torch.tensor([[2.0, 1.0, inf, inf], [inf, 3.0, 3.0, inf]])
    )
    assert torch.equal(top_k_filter(logits, 10), logits)
    # ties with the k-th value are kept: both 3.0 survive k=1
    assert torch.equal(top_k_filter(logits[1:], 1), torch.tensor([[inf, 3.0, 3.0, inf]]))

    # probabilities 0.5, 0.3, 0.2 (as logits: their logs)
    probs = torch.tensor([[0.2, 0.5, 0.3]])
    lp = probs.log()
    kept = lambda p: torch.isfinite(top_p_filter(lp, p))  # noqa: E731
    assert kept(0.5).tolist() == [[False, True, False]]  # 0.5 alone reaches 0.5
    assert kept(0.51).tolist() == [[False, True, True]]  # 0.5 + 0.3 >= 0.51
    assert kept(0.8).tolist() == [[False, True, True]]
    assert kept(0.81).tolist() == [[True, True, True]]
    assert kept(1e-9).tolist() == [[False, True, False]]  # the top token always stays
    assert kept(1.0).tolist() == [[True, True, True]]
    assert torch.equal(top_p_filter(lp, 0.5)[0, 1], lp[0, 1])  # kept logits are unchanged

    torch.testing.assert_close(apply_temperature(logits, 2.0), logits / 2)
    assert apply_temperature(logits, 1.0) is logits
    soft = torch.softmax(apply_temperature(torch.tensor([1.0, 0.0]), 0.5), -1)
    assert math.isclose(float(soft[0]), 1 / (1 + math.exp(-2)), rel_tol=1e-6)
    for bad in (lambda: top_k_filter(logits, 0), lambda: top_p_filter(logits, 0.0)):
        with pytest.raises(ValueError):
            bad()


# ----------------------------------------------------------------------------------------
# EOS, padding, limits, streaming
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_eos_stops_rows_and_pads_finished_ones(cache):
    model = _model("baseline")
    ids = torch.randint(0, VOCAB, (3, 4))
    plain = generate(model, ids, max_new_tokens=10, do_sample=False).new_tokens
    eos = int(plain[0, 2])
    pad = 7
    out = generate(
        model,
        ids,
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=[eos],
        pad_token_id=pad,
        cache=cache,
    )
    # Expected: each row's plain tokens up to its first EOS, then the pad id.
    expected, stops = plain.clone(), []
    for row in range(3):
        hits = (plain[row] == eos).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else 10
        expected[row, stop:] = pad
        stops.append(stop)
    n = max(stops)
    assert out.num_new_tokens == n
    assert torch.equal(out.new_tokens, expected[:, :n])
    assert out.finished.tolist() == [bool((plain[row] == eos).any()) for row in range(3)]
    # One row alone stops right after its EOS.
    single = generate(model, ids[:1], max_new_tokens=10, do_sample=False, eos_token_id=eos)
    assert single.num_new_tokens == stops[0] and single.finished.tolist() == [True]
    assert int(single.sequences[0, -1]) == eos


def test_too_long_is_one_clear_error_before_any_work():
    model = _model("diff_v2")
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    ids = torch.zeros(1, 60, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"prompt length 60 \+ max_new_tokens 5 = 65.*max_seq_len=64"
    ):
        generate(model, ids, max_new_tokens=5)
    assert calls == []
    assert generate(model, ids, max_new_tokens=4, do_sample=False).sequences.shape == (1, 64)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_streamer_receives_every_token_in_order(cache):
    model = _model("diff_v1")
    ids = torch.randint(0, VOCAB, (2, 3))
    seen = []
    out = generate(model, ids, max_new_tokens=7, seed=0, streamer=seen.append, cache=cache)
    assert len(seen) == 7 and torch.equal(torch.stack(seen, 1), out.new_tokens)

    class Recorder:
        def __init__(self):
            self.tokens, self.ended = [], 0

        def put(self, tokens):
            assert not self.ended
            self.tokens.append(tokens.tolist())

        def end(self):
            self.ended += 1

    recorder = Recorder()
    out = generate(model, ids, max_new_tokens=7, seed=0, streamer=recorder, cache=cache)
    assert recorder.ended == 1 and recorder.tokens == out.new_tokens.T.tolist()


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"eos_token_id": []}, "eos_token_id"),
        ({"eos_token_id": -1}, "eos_token_id"),
        ({"pad_token_id": "x"}, "pad_token_id"),
        ({"cache": "paged"}, "cache"),
        ({"compile": True}, "compile"),
        ({"compile": "always"}, "compile"),
        ({"compile": 1}, "compile"),
        ({"compile_mode": "fast"}, "compile_mode"),
        ({"seed": 1.5}, "seed"),
        ({"prefill_chunk_size": 0}, "prefill_chunk_size"),
        ({"do_sample": "yes"}, "do_sample"),
    ],
)
def test_config_errors_name_the_field(settings, field):
    with pytest.raises(ValueError, match=rf"GenerationConfig\.{field}"):
        GenerationConfig(**settings)


def test_bad_inputs_are_clear_errors():
    model = _model("baseline")
    ids = torch.randint(0, VOCAB, (2, 4))
    with pytest.raises(ValueError, match=r"unknown setting.*'top_q'"):
        generate(model, ids, top_q=0.5)
    with pytest.raises(ValueError, match="pad on the left"):
        generate(model, ids, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="does not match"):
        generate(model, ids, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="vocabulary"):
        generate(model, ids, eos_token_id=VOCAB)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(model, ids + VOCAB)
    with pytest.raises(ValueError, match="streamer"):
        generate(model, ids, streamer=42)
    config = GenerationConfig(eos_token_id=[3, 4])
    assert config.eos_token_ids == (3, 4) and config.replace(top_k=5).top_k == 5
    assert GenerationConfig(temperature=0).greedy and GenerationConfig(do_sample=False).greedy


# ----------------------------------------------------------------------------------------
# torch.compile of the static decode step
@pytest.mark.parametrize("attention", TYPES)
def test_cache_position_steps_equal_the_full_forward_and_mix_with_appends(attention):
    model = _model(attention)
    ids = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = StaticCache(model.config, 2, 12)
        buffer_mask = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
        pieces = [decode_step(model, cache, ids[:, :5], buffer_mask, torch.arange(5))]
        pieces += [decode_step(model, cache, ids[:, 5:6], buffer_mask, torch.tensor([5]))]
        assert cache.get_seq_length() == 6  # read back from the device once, when asked
        for t in (6, 7, 8):  # then the appending (Python int) mode continues the same buffer
            out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache)
            pieces.append(out.logits[:, -1])
    assert cache.get_seq_length() == 9
    real = mask.bool()[:, 4:]
    assert _rel(torch.stack(pieces, 1)[real], full[:, 4:][real]) <= 1e-5
    with pytest.raises(ValueError, match="needs a pre-allocated cache"):
        model(ids[:, :1], use_cache=True, cache_position=torch.tensor([0]))
    with pytest.raises(ValueError, match="cover the static buffer"):
        model(
            ids[:, :1], attention_mask=mask, past_key_values=cache, cache_position=torch.tensor([0])
        )
    with pytest.raises(ValueError, match="int64 tensor of shape"):
        model(ids[:, :2], past_key_values=cache, cache_position=torch.tensor([0]))


def _static_steps(model, cache, ids, mask, prompt, steps):
    """Yield ``(i, args)`` for decode steps ``i`` after an eager prefill of ``cache``."""
    decode_step(model, cache, ids[:, :prompt], mask, torch.arange(prompt))
    for i, slot in enumerate(range(prompt, prompt + steps)):
        yield i, (ids[:, slot : slot + 1], mask, torch.arange(slot, slot + 1))


def _compiled_decode_matches_eager(
    attention, model_backend, compile_backend, steps=6, step=decode_step, **compile_options
):
    """Decode with ``torch.compile(step)`` and eagerly side by side into two static caches.
    Returns the largest relative logit difference; asserts that from the third decode step
    on nothing is compiled or recompiled (``error_on_recompile`` and Dynamo's counters)."""
    torch._dynamo.reset()
    counters.clear()
    model = _model(attention, backend=model_backend)
    bsz, prompt = 2, 5
    length = prompt + steps + 1
    ids = torch.randint(0, VOCAB, (bsz, length))
    mask = torch.ones(bsz, length, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row
    caches = [StaticCache(model.config, bsz, length) for _ in range(2)]
    compiled = torch.compile(step, backend=compile_backend, **compile_options)
    worst, snapshot = 0.0, None
    with torch.no_grad():
        decode_step(model, caches[1], ids[:, :prompt], mask, torch.arange(prompt))
        for i, args in _static_steps(model, caches[0], ids, mask, prompt, steps):
            if i == 2:
                snapshot = (dict(counters["frames"]), dict(counters["stats"]))
            with torch._dynamo.config.patch(error_on_recompile=i >= 2):
                got = compiled(model, caches[0], *args)
            want = decode_step(model, caches[1], *args)
            worst = max(worst, _rel(got, want))
    assert snapshot[0].get("total", 0) > 0  # something was compiled at all
    assert (dict(counters["frames"]), dict(counters["stats"])) == snapshot  # nothing since
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == prompt + steps
    assert _rel(caches[0].keys[1], caches[1].keys[1]) <= 1e-5
    return worst


@pytest.mark.parametrize("attention", TYPES)
def test_compiled_static_decode_step_matches_eager(attention):
    """Fast check through Dynamo (backend "eager") with the single-graph reference kernels:
    equal logits and cache, no per-token recompiles."""
    assert _compiled_decode_matches_eager(attention, "reference", "eager") <= 1e-5


def test_compiled_static_decode_step_with_sdpa_graph_breaks():
    """SDPA's padding dispatch reads values back (graph breaks); still no recompiles."""
    assert _compiled_decode_matches_eager("diff_v2", "sdpa", "eager", steps=4) <= 1e-5


def _int_position_step(model, cache, input_ids, attention_mask, cache_position):
    """A decode step that turns the slot into a Python int: specialised per token."""
    slot = int(cache_position[0])
    return decode_step(model, cache, input_ids, attention_mask, torch.arange(slot, slot + 1))


def test_the_recompile_check_catches_per_token_recompiles():
    with pytest.raises(torch._dynamo.exc.RecompileError):
        _compiled_decode_matches_eager(
            "baseline", "reference", "eager", step=_int_position_step, dynamic=False
        )


def test_static_decode_step_captures_one_graph_with_reference_kernels():
    torch._dynamo.reset()
    model = _model("diff_v1", backend="reference")
    cache = StaticCache(model.config, 2, 10)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 0] = 0
    with torch.no_grad():
        decode_step(model, cache, torch.ones(2, 3, dtype=torch.long), mask, torch.arange(3))
        explained = torch._dynamo.explain(decode_step)(
            model, cache, torch.ones(2, 1, dtype=torch.long), mask, torch.tensor([3])
        )
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.parametrize("attention", TYPES)
def test_generate_compiled_gives_eager_tokens_with_one_compilation(attention):
    """Greedy tokens of a left-padded batch, decoded eagerly and compiled twice (``auto``
    backend, AOT autograd); the second compiled run, into a new cache of the same shape, must
    not compile anything."""
    torch._dynamo.reset()
    counters.clear()
    model = _model(attention)
    ids = torch.randint(0, VOCAB, (3, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    greedy = dict(max_new_tokens=7, do_sample=False)
    eager = generate(model, ids, mask, **greedy)
    compiled = dict(greedy, compile=True, cache="static", compile_backend="aot_eager")
    first = generate(model, ids, mask, **compiled)  # compiles (and settles auto's choices)
    assert counters["stats"]["unique_graphs"] >= 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = generate(model, ids, mask, **compiled)
    assert torch.equal(first.sequences, eager.sequences)
    assert torch.equal(again.sequences, eager.sequences)


def test_decoding_plan_compiles_on_cuda_only_when_auto():
    model = _model("diff_v1")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decoding_plan(GenerationConfig(), model, cuda) == ("dynamic", None)  # the default
    auto = GenerationConfig(compile="auto")
    assert decoding_plan(auto, model, cpu) == ("dynamic", None)
    assert decoding_plan(auto.replace(cache="static"), model, cpu) == ("static", None)
    assert decoding_plan(auto, model, cuda) == ("static", "reduce-overhead")
    assert decoding_plan(auto.replace(compile_mode="default"), model, cuda) == ("static", "default")
    forced = GenerationConfig(compile=True, cache="static")
    assert decoding_plan(forced, model, cpu) == ("static", "default")
    assert decoding_plan(forced, model, cuda) == ("static", "reduce-overhead")
    flash = _model("diff_v1", backend="flash")
    assert decoding_plan(auto, flash, cuda) == ("dynamic", None)  # flash takes no static cache


def test_cuda_graph_steps_each_start_a_new_replay(monkeypatch):
    """A CUDA-graph step marks a new step before each call (so the previous step's outputs may
    be overwritten); the plain compile does not wrap the step."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    compiled_decode_step.cache_clear()
    try:
        model = _model("diff_v2", backend="reference")
        ids = torch.randint(0, VOCAB, (2, 4))
        greedy = dict(max_new_tokens=5, do_sample=False)
        compiled = dict(greedy, compile=True, cache="static", compile_backend="eager")
        eager = generate(model, ids, **greedy)
        graphs = generate(model, ids, **compiled, compile_mode="reduce-overhead")
        assert torch.equal(graphs.sequences, eager.sequences) and len(marks) == 4
        generate(model, ids, **compiled)
        assert len(marks) == 4
    finally:
        compiled_decode_step.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", TYPES)
def test_cuda_graph_decoding_gives_eager_tokens(attention):
    """On CUDA, ``compile="auto"``: CUDA graphs (no step skipped them), eager's greedy tokens
    with left padding, and nothing compiled for a second run of the same shape."""
    torch._dynamo.reset()
    counters.clear()
    model = _model(attention, backend="sdpa").cuda()
    ids = torch.randint(0, VOCAB, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    eager = generate(model, ids, mask, max_new_tokens=12, do_sample=False)
    generate(model, ids, mask, max_new_tokens=12, do_sample=False, compile="auto")  # compiles
    with torch._dynamo.config.patch(error_on_recompile=True):
        graphs = generate(model, ids, mask, max_new_tokens=12, do_sample=False, compile="auto")
    assert torch.equal(graphs.sequences, eager.sequences)
    assert counters["inductor"].get("cudagraph_skips", 0) == 0


@pytest.mark.slow
@pytest.mark.parametrize("attention", TYPES)
def test_compiled_static_decode_step_inductor(attention):
    """Inductor (C++ on CPU): the generated code gives eager's logits, compiled once."""
    assert _compiled_decode_matches_eager(attention, "reference", "inductor") <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("attention", TYPES)
@pytest.mark.parametrize("compile_backend", ["eager", "inductor"])
def test_compiled_static_decode_step_sdpa(attention, compile_backend):
    assert _compiled_decode_matches_eager(attention, "sdpa", compile_backend) <= 1e-5


# ----------------------------------------------------------------------------------------
# the CLI verb
FIXTURE_TEXT = (
    "Differential attention subtracts two softmax maps to cancel attention noise. "
    "Le café coûte deux euros. 日本語のテキストも少し。 Emoji: 🙂🚀. "
) * 20


def _byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([FIXTURE_TEXT], trainer)
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers

    raw = _byte_level_tokenizer()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")
    torch.manual_seed(0)
    model = _model("diff_v1", vocab_size=raw.get_vocab_size(), max_seq_len=128)
    return save_model(model, tmp_path_factory.mktemp("gen") / "model", tokenizer=hf)


def _cli(argv):
    from diffattn.commands.generate import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(argv))


class _Stdout:
    """Records every write and flush, like a terminal that shows text as it arrives."""

    def __init__(self):
        self.writes, self.flushes = [], 0

    def write(self, text):
        self.writes.append(text)

    def flush(self):
        self.flushes += 1


def test_cli_streams_the_decoded_final_sequence(model_dir, monkeypatch):
    from transformers import AutoTokenizer

    from diffattn.checkpoint import load_model

    stdout = _Stdout()
    monkeypatch.setattr(sys, "stdout", stdout)
    prompt = "Le café 🙂"
    assert _cli([str(model_dir), "--prompt", prompt, "--max-new-tokens", "24", "--seed", "5"]) == 0
    monkeypatch.undo()

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    result = generate(
        load_model(model_dir),
        torch.tensor([tokenizer.encode(prompt)]),
        max_new_tokens=24,
        seed=5,
        eos_token_id=tokenizer.eos_token_id,
    )
    text = tokenizer.decode(result.sequences[0].tolist(), skip_special_tokens=True)
    assert "".join(stdout.writes) == text + "\n"
    assert text.startswith(prompt)
    assert len(stdout.writes) > 4 and stdout.flushes >= len(stdout.writes)  # piece by piece


def test_cli_greedy_static_cache_and_no_echo(model_dir, capsys):
    base = [str(model_dir), "--prompt", "Differential", "--temperature", "0"]
    assert _cli([*base, "--max-new-tokens", "10"]) == 0
    full = capsys.readouterr().out
    assert _cli([*base, "--max-new-tokens", "10", "--cache", "static", "--no-echo"]) == 0
    continuation = capsys.readouterr().out
    assert full == "Differential" + continuation and len(continuation) > 1
    compiled_decode_step.cache_clear()
    assert _cli([*base, "--max-new-tokens", "10", "--auto-compile", "--no-echo"]) == 0
    assert capsys.readouterr().out == continuation
    assert compiled_decode_step.cache_info().currsize == 0  # on the CPU, "auto" stays eager
    with pytest.raises(SystemExit):
        _cli([*base, "--compile", "--auto-compile"])
    with pytest.raises(SystemExit):
        _cli([*base, "--compile-mode", "fastest"])


def test_text_streamer_holds_back_split_characters():
    from diffattn.commands.generate import TextStreamer
    from diffattn.loading import TextTokenizer

    raw = _byte_level_tokenizer()
    tokenizer = TextTokenizer(raw)
    text = "ü€ 🧪 ok"  # characters absent from the training text: one token per byte
    ids = raw.encode(text).ids
    assert len(ids) > len(text)
    pieces = []
    streamer = TextStreamer(tokenizer, write=pieces.append)
    for token in ids:
        streamer.put(torch.tensor([token]))
    streamer.end()
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert len(pieces) <= len(text)  # nothing is written until a character is complete


def test_cli_missing_model_or_tokenizer_is_one_clear_error(model_dir, tmp_path):
    with pytest.raises(CheckpointError, match="model directory not found"):
        _cli([str(tmp_path / "nowhere"), "--prompt", "x"])
    bare = save_model(_model("baseline"), tmp_path / "bare")
    with pytest.raises(CheckpointError, match=r"no tokenizer \(looked for tokenizer\.json"):
        _cli([str(bare), "--prompt", "x"])
    with pytest.raises(ValueError, match="max_seq_len"):
        _cli([str(model_dir), "--prompt", "x", "--max-new-tokens", "500"])
    with pytest.raises(ValueError, match=r"GenerationConfig\.top_p"):
        _cli([str(model_dir), "--prompt", "x", "--top-p", "2"])


def _copy_without_tokenizer(model_dir, target):
    target.mkdir()
    for name in ("config.json", "model.safetensors"):
        (target / name).write_bytes((model_dir / name).read_bytes())
    return target


@pytest.mark.parametrize("broken", [False, True])
def test_main_without_a_tokenizer_is_one_line_naming_the_files_and_the_fix(
    model_dir, tmp_path, capsys, broken
):
    from diffattn.cli import main

    bare = _copy_without_tokenizer(model_dir, tmp_path / "bare")
    if broken:  # a config without the tokenizer it describes: transformers' multi-line error
        (bare / "tokenizer_config.json").write_text("{}")
    assert main(["generate", str(bare), "--prompt", "x"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"diffattn generate: error: {bare}: ")
    if broken:
        assert "cannot load the tokenizer" in lines[0]
    else:
        assert "tokenizer.json and tokenizer_config.json" in lines[0]
        assert "--tokenizer DIR" in lines[0] and "tokenizer/" in lines[0]


def test_cli_tokenizer_option_reads_the_tokenizer_from_another_directory(
    model_dir, tmp_path, capsys
):
    bare = _copy_without_tokenizer(model_dir, tmp_path / "bare")
    argv = ["--prompt", "Differential", "--temperature", "0", "--max-new-tokens", "10"]
    assert _cli([str(model_dir), *argv]) == 0
    beside = capsys.readouterr().out
    assert _cli([str(bare), *argv, "--tokenizer", str(model_dir)]) == 0
    assert capsys.readouterr().out == beside and len(beside) > len("Differential") + 1
    with pytest.raises(CheckpointError, match=r"--tokenizer .*: no tokenizer \(looked for"):
        _cli([str(model_dir), *argv, "--tokenizer", str(tmp_path / "nowhere")])


@pytest.mark.parametrize("hide_transformers", [False, True])
def test_cli_with_bare_tokenizer_json_and_generation_config_eos(
    tmp_path, capsys, monkeypatch, hide_transformers
):
    raw = _byte_level_tokenizer()
    model = _model("diff_v2", vocab_size=raw.get_vocab_size(), max_seq_len=128)
    prompt = raw.encode("Differential attention").ids
    plain = generate(model, torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    eos = int(plain.new_tokens[0, 2])
    stop = int((plain.new_tokens[0] == eos).nonzero()[0]) + 1  # first EOS, then stop
    writer = {
        "generation_config.json": lambda path: path.write_text(f'{{"eos_token_id": [{eos}]}}')
    }
    directory = save_model(model, tmp_path / "m", tokenizer=raw, extra_files=writer)
    assert not (directory / "tokenizer_config.json").exists()
    if hide_transformers:
        monkeypatch.setitem(sys.modules, "transformers", None)  # import fails: tokenizers path
    argv = [str(directory), "--prompt", "Differential attention", "--temperature", "0"]
    assert _cli([*argv, "--max-new-tokens", "8"]) == 0
    expected = raw.decode(prompt + plain.new_tokens[0, :stop].tolist())
    assert capsys.readouterr().out == expected + "\n"
