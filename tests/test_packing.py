"""Documents packed in one row never see each other: every CPU backend, every attention type,
fp32, outputs and gradients equal running each document alone; RoPE restarts per document, no
loss target crosses a boundary, and max_seq_len bounds each document."""

from __future__ import annotations

import pytest
import torch

from diffattn import DiffTransformerLM
from diffattn.model import documents_from_positions, positions_in_documents
from helpers import ATTENTIONS, TINY_VOCAB, tiny_config

BACKENDS = ("reference", "sdpa", "fused", "auto")
TOL = dict(rtol=2e-5, atol=2e-5)


def model_for(attention: str, backend: str, **overrides) -> DiffTransformerLM:
    torch.manual_seed(0)
    config = tiny_config(attention, max_seq_len=160, backend=backend, **overrides)
    return DiffTransformerLM(config).eval()


def packed(lengths: list[int], seed: int = 0):
    """``(input_ids (1, N), document_ids (1, N), the documents' ids)``."""
    generator = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, TINY_VOCAB, (n,), generator=generator) for n in lengths]
    ids = torch.cat(docs)[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    return ids, document_ids, docs


def weighted_logits(logits: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A scalar that depends on every logit (for gradients of every parameter)."""
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
    weights = weights.to(logits.dtype)
    return (logits * weights).sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("lengths", [[1, 7, 129], [7, 1], [129, 1, 7, 3]], ids=str)
def test_packed_documents_equal_each_alone_outputs_and_gradients(attention, backend, lengths):
    model = model_for(attention, backend)
    ids, document_ids, docs = packed(lengths)
    packed_logits = model(ids, document_ids=document_ids).logits[0]
    alone_logits = torch.cat([model(doc[None]).logits[0] for doc in docs])
    torch.testing.assert_close(packed_logits, alone_logits, **TOL)

    model.zero_grad()
    weighted_logits(model(ids, document_ids=document_ids).logits[0]).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    weighted_logits(torch.cat([model(doc[None]).logits[0] for doc in docs])).backward()
    for name, p in model.named_parameters():
        # Relative to the gradient's norm: the row and the documents sum in another fp32 order
        # (the kernels and norms compute in fp32 whatever the model's dtype), and λ's gradient
        # is a sum of terms of both signs: the same documents, alone, on `reference` and on
        # `sdpa` give λ gradients 1.1e-4 apart (relative to their norm). Attention leaking
        # across a boundary moves gradients by far more (the outputs above differ by ~1e-1).
        error = (packed_grads[name] - p.grad).norm() / p.grad.norm().clamp_min(1e-12)
        assert error < 5e-4, (name, error.item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_one_document_is_todays_path(attention, backend):
    model = model_for(attention, backend)
    ids, _, _ = packed([40])
    plain = model(ids).logits
    one = model(ids, document_ids=torch.zeros_like(ids)).logits
    assert torch.equal(one, plain)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_restarting_positions_are_documents(attention):
    """Hugging Face's padding-free format (``DataCollatorWithFlattening``): one row, positions
    restarting at 0, no mask: each document computes what it computes alone."""
    model = model_for(attention, "auto")
    ids, document_ids, docs = packed([5, 9, 3])
    positions = positions_in_documents(document_ids, None)
    assert positions.tolist() == [[*range(5), *range(9), *range(3)]]
    by_positions = model(ids, position_ids=positions).logits[0]
    alone = torch.cat([model(doc[None]).logits[0] for doc in docs])
    torch.testing.assert_close(by_positions, alone, **TOL)
    assert torch.equal(documents_from_positions(positions), document_ids)
    assert documents_from_positions(torch.arange(6)[None]) is None


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_padded_rows_of_packed_documents(attention):
    """Two rows, right-padded, each packing documents: real tokens get their documents' own
    outputs, with positions counting each document's real tokens."""
    model = model_for(attention, "auto")
    ids_a, docs_a, alone_a = packed([4, 6], seed=1)
    ids_b, docs_b, alone_b = packed([3, 2], seed=2)
    pad = ids_a.shape[1] - ids_b.shape[1]
    ids = torch.cat([ids_a, torch.nn.functional.pad(ids_b, (0, pad))])
    document_ids = torch.cat([docs_a, torch.nn.functional.pad(docs_b, (0, pad), value=2)])
    mask = torch.ones_like(ids)
    mask[1, ids_b.shape[1] :] = 0
    logits = model(ids, attention_mask=mask, document_ids=document_ids).logits
    torch.testing.assert_close(
        logits[0], torch.cat([model(d[None]).logits[0] for d in alone_a]), **TOL
    )
    torch.testing.assert_close(
        logits[1, : ids_b.shape[1]], torch.cat([model(d[None]).logits[0] for d in alone_b]), **TOL
    )


def test_the_loss_never_crosses_a_boundary():
    model = model_for("diff_v1", "auto")
    ids, document_ids, docs = packed([6, 9, 4])
    loss = model(ids, labels=ids, document_ids=document_ids).loss
    sums = [model(d[None], labels=d[None]).loss * (len(d) - 1) for d in docs]
    expected = sum(sums) / sum(len(d) - 1 for d in docs)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_max_seq_len_bounds_each_document_not_the_row():
    model = model_for("baseline", "auto")  # max_seq_len 160
    ids, document_ids, _ = packed([150, 150])
    assert model(ids, document_ids=document_ids).logits.shape[1] == 300
    ids, document_ids, _ = packed([161, 3])
    with pytest.raises(ValueError, match="a packed document of 161 tokens exceeds max_seq_len=160"):
        model(ids, document_ids=document_ids)
    with pytest.raises(ValueError, match="sequence length 300 exceeds max_seq_len=160"):
        model(torch.zeros(1, 300, dtype=torch.long))


def test_documents_are_refused_where_they_cannot_hold():
    from diffattn.cache import DynamicCache

    model = model_for("baseline", "auto")
    ids, document_ids, _ = packed([3, 4])
    with pytest.raises(
        ValueError, match=r"document_ids must be an integer tensor of shape \(1, 7\)"
    ):
        model(ids, document_ids=document_ids[:, :5])
    cache = DynamicCache()
    model(ids[:, :2], past_key_values=cache)
    with pytest.raises(ValueError, match="cannot follow cached tokens"):
        model(ids, document_ids=document_ids, past_key_values=cache)
    full = torch.ones(1, 1, 7, 7, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="give one"):
        model(ids, attention_mask=full, document_ids=document_ids)


def test_backends_without_document_masks_hand_them_to_sdpa():
    from diffattn.attention.registry import get_backend

    for name in ("flash", "triton"):
        try:
            backend = get_backend(name)
        except (KeyError, ValueError):
            continue
        assert not backend.custom_masks, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["sdpa", "auto", "flash", "triton", "fused"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_packed_documents_on_cuda(attention, backend, dtype):
    """The GPU check's part (``-m gpu``): every CUDA backend, fp32 and bf16, packed documents
    against each alone (outputs; bf16 within 2e-2 of the largest logit)."""
    from diffattn.attention.registry import get_backend

    probe = torch.zeros(1, 1, 1, 16, device="cuda", dtype=dtype)
    unusable = get_backend(backend).unusable
    reason = unusable(probe) if unusable is not None else None
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    model = model_for(attention, backend).to("cuda", dtype)
    ids, document_ids, docs = packed([1, 7, 129, 40])
    with torch.no_grad():
        together = model(ids.cuda(), document_ids=document_ids.cuda()).logits[0].float()
        alone = torch.cat([model(d[None].cuda()).logits[0].float() for d in docs])
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert (together - alone).abs().max() <= tolerance * alone.abs().max()


def test_an_id_that_comes_back_is_another_document():
    """``[0, 1, 0]``: three runs, three documents for the mask, RoPE and the loss alike."""
    model = model_for("diff_v1", "auto")
    ids, _, docs = packed([4, 3, 5])
    reused = torch.tensor([[0] * 4 + [1] * 3 + [0] * 5])
    together = model(ids, document_ids=reused).logits[0]
    alone = torch.cat([model(d[None]).logits[0] for d in docs])
    torch.testing.assert_close(together, alone, **TOL)


def test_a_packed_row_fills_no_cache():
    model = model_for("baseline", "auto")
    ids, document_ids, _ = packed([3, 4])
    with pytest.raises(ValueError, match="cannot fill a KV cache"):
        model(ids, document_ids=document_ids, use_cache=True)
    assert model(ids, document_ids=document_ids).past_key_values is None


def _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale):
    """What flash-attn's ``flash_attn_varlen_func`` computes, in plain PyTorch: each sequence of
    ``cu_seqlens`` causal on its own (GQA by repeating KV heads). It checks the arguments the
    flash backend hands over; flash-attn itself needs CUDA."""
    assert causal and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    assert max_q == max_k == max(lengths) and cu_q[-1] == len(q)
    parts = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
        qh, kh, vh = (x.transpose(0, 1)[None] for x in (qs, ks, vs))
        rep = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=softmax_scale
        )
        parts.append(out[0].transpose(0, 1))
    return torch.cat(parts)


@pytest.mark.parametrize("padded", [False, True])
def test_flash_hands_each_document_to_varlen_as_one_sequence(monkeypatch, padded):
    """The flash backend's var-len route (``cu_seqlens`` per document and row, padding left
    out and reading itself) against ``reference``, with a stand-in for the CUDA kernel: GQA,
    documents of 1, 7 and 129 tokens, rows that end inside a document."""
    import sys
    import types

    from diffattn.attention.backends.flash import document_sequences, flash_attention
    from diffattn.attention.backends.reference import reference_attention
    from diffattn.attention.mask import AttentionMask
    from diffattn.model import document_runs

    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_varlen_stand_in)
    )
    generator = torch.Generator().manual_seed(0)
    n = 137
    q = torch.randn(2, 4, n, 16, generator=generator)
    k, v = (torch.randn(2, 2, n, 16, generator=generator) for _ in range(2))
    ids = torch.tensor([[0] * 1 + [1] * 7 + [2] * 129, [0] * 129 + [1] * 7 + [2] * 1])
    key_padding = None
    if padded:
        key_padding = torch.ones(2, n, dtype=torch.bool)
        key_padding[1, -5:] = False
        key_padding[0, :3] = False
    mask = AttentionMask(key_padding=key_padding, document_ids=document_runs(ids))
    results = []
    for attend in (flash_attention, lambda *a: reference_attention(*a)[0]):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attend(*inputs, mask, 0.25)
        weighted_logits(out).backward()
        results.append((out, *(x.grad for x in inputs)))
    for fast, reference in zip(*results, strict=True):
        torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    cu, longest = document_sequences(document_runs(ids), torch.ones(2, n, dtype=torch.bool))
    assert cu.tolist() == [0, 1, 8, 137, 266, 273, 274] and longest == 129


def test_documents_that_are_not_an_integer_tensor_are_refused_by_name():
    model = model_for("baseline", "auto")
    ids, document_ids, _ = packed([3, 4])
    for given in (document_ids.tolist(), document_ids.numpy()):
        with pytest.raises(TypeError, match=r"document_ids must be a torch.Tensor of integers"):
            model(ids, document_ids=given)
    for dtype in (torch.complex64, torch.bool, torch.float32):
        with pytest.raises(ValueError, match=rf"integer tensor of shape \(1, 7\), got {dtype}"):
            model(ids, document_ids=document_ids.to(dtype))


def test_a_loss_over_no_target_is_an_error_not_a_nan():
    """Rows of one-token documents have nothing to predict."""
    model = model_for("baseline", "auto")
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="no loss target"):
        model(ids, labels=ids, document_ids=torch.tensor([[0, 1, 2, 3]]))
    # one target left (the first document has two tokens): a finite mean
    loss = model(ids, labels=ids, document_ids=torch.tensor([[0, 0, 1, 2]])).loss
    assert torch.isfinite(loss)
