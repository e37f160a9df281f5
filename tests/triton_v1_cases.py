"""Cases of the ``triton`` DIFF V1 kernels against the float64 reference: outputs and gradients
of q1, q2, k1, k2, v and λ. Run by ``test_triton_v1.py`` in a process with
``TRITON_INTERPRET=1`` (CPU, numpy) and, where there is a GPU, on CUDA; not collected alone."""

from __future__ import annotations

import os

import pytest
import torch

from diffattn.attention import kernels
from diffattn.attention.mask import AttentionMask
from test_fused_v1 import _padding, _rel

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
D = 16  # the smallest head width tl.dot takes on a GPU
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
GRAD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 6e-2, torch.float16: 1e-2}

SHAPES = [
    (1, "none", 1),
    *[(7, padding, gqa) for padding in ("none", "left", "right", "holes") for gqa in (1, 2)],
    (129, "none", 1),
    (129, "left", 2),
    (129, "holes", 1),
]


def _inputs(bsz, heads, kv_heads, n, s, d=D, dtype=torch.float32):
    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype, device=DEVICE).requires_grad_()

    q1, q2 = leaf(bsz, heads, n, d), leaf(bsz, heads, n, d)
    k1, k2 = leaf(bsz, kv_heads, s, d), leaf(bsz, kv_heads, s, d)
    v = leaf(bsz, kv_heads, s, 2 * d)
    lam = torch.tensor(0.37, device=DEVICE, requires_grad=True)
    return q1, q2, k1, k2, v, lam


def _mask(key_padding, offset=0):
    kp = None if key_padding is None else key_padding.to(DEVICE)
    return AttentionMask(key_padding=kp, query_offset=offset)


def _reference_mask(mask: AttentionMask) -> AttentionMask:
    kp = None if mask.key_padding is None else mask.key_padding.cpu()
    offset = mask.query_offset
    docs = None if mask.document_ids is None else mask.document_ids.cpu()
    return AttentionMask(
        kp, offset.cpu() if isinstance(offset, torch.Tensor) else offset, document_ids=docs
    )


def _outputs_and_grads(inputs, mask, weight, backend):
    scale = inputs[0].shape[-1] ** -0.5
    out, _ = kernels.differential_attention(*inputs, mask, scale, backend)
    grads = torch.autograd.grad((out.to(weight.dtype) * weight).sum(), inputs)
    return out, grads


def _assert_matches_reference(inputs, mask, backend="triton", call=None):
    """Outputs and gradients of ``backend`` (or of ``call(inputs, mask)``) against the
    ``reference`` backend in float64 on the CPU, at the inputs' dtype's tolerance."""
    dtype = inputs[0].dtype
    weight = torch.randn(*inputs[0].shape[:3], inputs[4].shape[-1], device=inputs[0].device)
    as64 = tuple(x.detach().cpu().double().requires_grad_() for x in inputs)
    ref, grads_ref = _outputs_and_grads(
        as64, _reference_mask(mask), weight.cpu().double(), "reference"
    )
    if call is None:
        out, grads = _outputs_and_grads(inputs, mask, weight, backend)
    else:
        out = call(inputs, mask)
        grads = torch.autograd.grad((out.float() * weight).sum(), inputs)
    assert out.dtype == dtype and out.shape == ref.shape and out.device == inputs[0].device
    assert _rel(out.cpu(), ref) <= TOLERANCE[dtype]
    grad_scale = max(float(g.abs().max()) for g in grads_ref)
    names = ("q1", "q2", "k1", "k2", "v", "lam")
    for name, g, g_ref, x in zip(names, grads, grads_ref, inputs, strict=True):
        assert g.dtype == x.dtype and g.device == x.device and torch.isfinite(g).all(), name
        # An exactly-zero reference (one key: softmax is constant) and dλ, a sum over every
        # output element that can cancel, are judged on the op's gradient scale.
        ref_max = float(g_ref.abs().max())
        scale = max(ref_max, grad_scale) if name == "lam" or ref_max == 0 else ref_max
        assert _rel(g.cpu(), g_ref, scale) <= GRAD_TOLERANCE[dtype], name


@pytest.mark.parametrize(("n", "padding", "gqa"), SHAPES)
def test_triton_matches_reference(n, padding, gqa):
    bsz, kv_heads = (1, 1) if n > 64 else (2, 2)  # the interpreter is slow: fewer heads
    inputs = _inputs(bsz, kv_heads * gqa, kv_heads, n, n)
    _assert_matches_reference(inputs, _mask(_padding(padding, bsz, n)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_every_head_width_and_dtype(d, dtype):
    inputs = _inputs(2, 4, 2, 7, 7, d=d, dtype=dtype)  # GQA 2, left padding
    _assert_matches_reference(inputs, _mask(_padding("left", 2, 7)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_many_tiles_at_the_papers_widths(d, dtype):
    n = 129 if INTERPRETED else 1000
    inputs = _inputs(1, 2, 1, n, n, d=d, dtype=dtype)
    _assert_matches_reference(inputs, _mask(_padding("right", 1, n)))


@pytest.mark.parametrize("n_new", [1, 5])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("offset_kind", [int, torch.tensor])
def test_triton_with_a_cache_offset_matches_reference(n_new, padded, offset_kind):
    s = 21
    key_padding = _padding("left", 2, s) if padded else None
    offset = offset_kind(s - n_new)
    if isinstance(offset, torch.Tensor):
        offset = offset.to(DEVICE)
    inputs = _inputs(2, 4, 2, n_new, s, d=32)
    _assert_matches_reference(inputs, _mask(key_padding, offset))


def test_strided_views_as_the_model_makes_them():
    """Q1/Q2 and K1/K2 as alternate heads of one (B, N, heads, d) projection seen as
    (B, heads, N, d), V transposed the same way: read in place, no copies needed."""

    def projection(heads, n, width):
        x = torch.randn(2, n, heads, width, device=DEVICE).transpose(1, 2)
        return x.detach().requires_grad_()

    q, k = projection(8, 7, 32), projection(4, 7, 32)
    v = projection(2, 7, 64)
    lam = torch.tensor(0.37, device=DEVICE, requires_grad=True)

    def attend(leaves, mask):
        q, k, v, lam = leaves
        inputs = (q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2], v, lam)
        return kernels.differential_attention(*inputs, mask, 32**-0.5, "triton")[0]

    mask = _mask(_padding("holes", 2, 7))
    out = attend((q, k, v, lam), mask)
    dense = tuple(x.detach().contiguous().requires_grad_() for x in (q, k, v, lam))
    expected = attend(dense, mask)
    assert not q[:, 0::2].is_contiguous() and torch.allclose(out, expected, atol=1e-6)
    grads = torch.autograd.grad(out.sum(), (q, k, v, lam))
    grads_dense = torch.autograd.grad(expected.sum(), dense)
    for g, g_dense in zip(grads, grads_dense, strict=True):
        assert torch.allclose(g, g_dense, atol=1e-5)


def test_no_host_synchronisation(monkeypatch):
    """λ, the padding and a tensor offset stay on the device: reading any tensor on the host
    (``item``, ``float``, ``int``, ``bool``) during forward and backward fails the test."""
    inputs = _inputs(2, 4, 2, 5, 21, d=32)
    mask = _mask(_padding("left", 2, 21), torch.tensor(16, device=DEVICE))
    weight = torch.randn(2, 4, 5, 64, device=DEVICE)

    def refuse(*_):
        raise AssertionError("a tensor was read on the host")

    _outputs_and_grads(inputs, mask, weight, "triton")  # autotuning (on a GPU) happens here
    with monkeypatch.context() as patch:
        for name in ("item", "__float__", "__int__", "__bool__", "__index__", "tolist"):
            patch.setattr(torch.Tensor, name, refuse)
        if DEVICE == "cuda":  # and CUDA itself reports any synchronising call as an error
            torch.cuda.set_sync_debug_mode("error")
        try:
            out, grads = _outputs_and_grads(inputs, mask, weight, "triton")
        finally:
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (2, 4, 5, 64) and len(grads) == 6


def test_compiled_fullgraph_matches_eager():
    """``torch.compile(fullgraph=True)`` keeps the custom op in the graph (no graph break, no
    N×N fallback) and gives eager's outputs and gradients."""
    from diffattn.attention.backends.triton_v1 import triton_diff_v1

    def attend(inputs, mask):
        return triton_diff_v1(*inputs, mask, 32**-0.5)

    compiled = torch.compile(attend, fullgraph=True)
    inputs = _inputs(2, 4, 2, 7, 7, d=32)
    mask = _mask(_padding("right", 2, 7))
    _assert_matches_reference(inputs, mask, call=compiled)
    eager, compiled_out = attend(inputs, mask), compiled(inputs, mask)
    assert torch.equal(eager, compiled_out)


def test_compiled_graph_holds_the_op_not_n_by_n_maps():
    from diffattn.attention.backends.triton_v1 import triton_diff_v1

    graphs = []

    def capture(graph_module, _example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def attend(inputs, mask):
        return triton_diff_v1(*inputs, mask, 32**-0.5)

    inputs = _inputs(1, 2, 1, 7, 7, d=32)
    torch.compile(attend, fullgraph=True, backend=capture)(inputs, _mask(None))
    code = graphs[0].code
    assert "triton_diff_v1_forward" in code and "softmax" not in code


@pytest.mark.parametrize("padding", ["none", "right", "holes"])
@pytest.mark.parametrize("gqa", [1, 2])
def test_packed_documents_match_reference(gqa, padding):
    """Documents packed in a row (``document_ids``): the kernels read them as key segments, in
    forward and both backward kernels; documents of 1, 7, 20 and 5 tokens, two layouts."""
    lengths = [1, 7, 20, 5]
    n = sum(lengths)
    documents = torch.cat([torch.full((k,), i) for i, k in enumerate(lengths)])
    documents = torch.stack([documents, 3 - documents.flip(0)]).to(DEVICE)
    padding_mask = _padding(padding, 2, n)
    mask = AttentionMask(
        key_padding=None if padding_mask is None else padding_mask.to(DEVICE),
        document_ids=documents,
    )
    _assert_matches_reference(_inputs(2, 2 * gqa, 2, n, n), mask)


def test_custom_ops_pass_opcheck():
    from diffattn.attention.triton_diff_v1 import op

    inputs = tuple(x.detach() for x in _inputs(1, 2, 1, 7, 7, d=16))
    kp = _padding("left", 1, 7).to(DEVICE)
    args = (*inputs, kp, None, 0, 0.25)
    torch.library.opcheck(op.triton_diff_v1_forward, args)
    out, o2, lse1, lse2 = op.triton_diff_v1_forward(*args)
    grad = torch.randn_like(out)
    torch.library.opcheck(op.triton_diff_v1_backward, (grad, *args, out, o2, lse1, lse2))


def test_bad_lambda_is_one_clear_error():
    q1, q2, k1, k2, v, _ = _inputs(1, 2, 1, 3, 3)
    with pytest.raises(ValueError, match="one λ"):
        kernels.differential_attention(
            q1, q2, k1, k2, v, torch.ones(2, device=DEVICE), _mask(None), 0.25, "triton"
        )


MODELS = {
    "diff_v1": dict(attention="diff_v1"),
    "gda-3to1": dict(attention="gda", attention_options={"gda": {"ratio": 3}}),
}
"""GDA runs DIFF V1's entry point (its noise heads' maps shared by their signal heads), so the
Triton kernel runs it as it is: 3 signal heads over 1 noise head here."""


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_model_trains_and_generates_as_on_the_reference(name):
    """A whole DIFF V1 or GDA model (head width 32, 2 KV heads, left padding): loss and every
    parameter's gradient, then greedy prefill + decode, on ``triton`` equal those on
    ``reference``."""
    from diffattn.generation import generate
    from helpers import tiny_diffattn

    fields = dict(MODELS[name])
    model = tiny_diffattn(fields.pop("attention"), d_model=128, n_heads=4, n_kv_heads=2, **fields)
    model = model.to(DEVICE)
    ids = torch.randint(0, 50, (2, 9), device=DEVICE)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :2] = 0

    def loss_and_grads(backend):
        model.set_backend(backend)
        model.zero_grad()
        loss = model(ids, attention_mask=attention_mask, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = loss_and_grads("triton")
    loss_ref, grads_ref = loss_and_grads("reference")
    assert torch.allclose(loss, loss_ref, rtol=1e-5)
    for key, g_ref in grads_ref.items():
        # λ's gradients are sums over every output element of the layer, which cancel (GDA 3:1
        # here: 2.9e-3 of their own size on triton, 6e-4 on sdpa): judged, as the kernel's
        # dλ above, on the scale of the layer's other gradients.
        scale = None
        if ".lambda_" in key:
            layer = key.rpartition(".")[0]
            scale = max(float(grads_ref[k].abs().max()) for k in grads_ref if k.startswith(layer))
        assert _rel(grads[key], g_ref, scale) <= 1e-4, key
    outputs = {}
    for backend in ("triton", "reference"):
        model.set_backend(backend)
        with torch.no_grad():
            outputs[backend] = generate(
                model, ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False
            ).sequences
    assert torch.equal(outputs["triton"], outputs["reference"])


def test_padding_of_the_wrong_shape_is_one_clear_error():
    inputs = _inputs(2, 2, 1, 3, 5)
    with pytest.raises(ValueError, match=r"key_padding of shape \(B, S\) = \(2, 5\)"):
        kernels.differential_attention(
            *inputs, _mask(torch.ones(2, 3, dtype=torch.bool)), 0.25, "triton"
        )
