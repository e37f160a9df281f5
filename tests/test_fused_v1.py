"""The ``fused`` DIFF V1 kernel against the reference backend: outputs and gradients of q1, q2,
k1, k2, v and λ over odd lengths, padding, GQA, KV-cache offsets and custom masks."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from diffattn import DiffTransformerLM
from diffattn.attention import cpu_kernel, kernels, registry
from diffattn.attention.backends import fused
from diffattn.attention.backends.reference import differential_rows
from diffattn.attention.backends.sdpa import sdpa_diff_v1
from diffattn.attention.mask import AttentionMask
from helpers import TINY_VOCAB, LargestTensor, tiny_diffattn

D = 8


def _padding(kind: str, bsz: int, n: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    mask = torch.ones(bsz, n, dtype=torch.bool)
    if kind == "left":
        mask[0, : min(3, n - 1)] = False
    elif kind == "right":
        mask[0, max(1, n - 3) :] = False
    elif kind == "holes":
        mask[0, 1::3] = False
    return mask


def _inputs(bsz, heads, kv_heads, n, s, dtype=torch.float32, d=D):
    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype).requires_grad_()

    q1, q2 = leaf(bsz, heads, n, d), leaf(bsz, heads, n, d)
    k1, k2 = leaf(bsz, kv_heads, s, d), leaf(bsz, kv_heads, s, d)
    v = leaf(bsz, kv_heads, s, 2 * d)
    lam = torch.tensor(0.37, requires_grad=True)
    return q1, q2, k1, k2, v, lam


def _outputs_and_grads(backend: str, inputs, mask, weight):
    scale = inputs[0].shape[-1] ** -0.5
    out, _ = kernels.differential_attention(*inputs, mask, scale, backend)
    grads = torch.autograd.grad((out.float() * weight).sum(), inputs)
    return out, grads


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
    """max|a − b| / max|b|, or over ``scale`` when given."""
    a, b = a.detach().float(), b.detach().float()
    denominator = float(b.abs().max()) if scale is None else scale
    return float((a - b).abs().max()) / max(denominator, 1e-12)


def _assert_matches_reference(inputs, mask, tol=1e-5, backend="fused"):
    weight = torch.randn(*inputs[0].shape[:3], inputs[4].shape[-1])
    ref, grads_ref = _outputs_and_grads("reference", inputs, mask, weight)
    out, grads = _outputs_and_grads(backend, inputs, mask, weight)
    assert out.dtype == inputs[0].dtype and out.shape == ref.shape
    assert _rel(out, ref) <= tol
    grad_scale = max(float(g.abs().max()) for g in grads_ref)
    names = ("q1", "q2", "k1", "k2", "v", "lam")
    for name, g, g_ref in zip(names, grads, grads_ref, strict=True):
        assert g.dtype == g_ref.dtype and torch.isfinite(g).all(), name
        # An exactly-zero reference (one key: softmax is constant) and dλ, a sum over every
        # output element that can cancel, are judged on the op's gradient scale.
        ref_max = float(g_ref.abs().max())
        scale = max(ref_max, grad_scale) if name == "lam" or ref_max == 0 else ref_max
        assert _rel(g, g_ref, scale) <= tol, name


@pytest.fixture(autouse=True, params=["compiled", "blocked"])
def kernel_path(request, monkeypatch):
    """Every test runs on both CPU paths of the backend: the compiled kernel (tiles of 4 rows,
    so lengths 7 and 129 cover one and many tiles, GQA groups split across tiles) and the
    blocked PyTorch path (blocks of 16 query rows)."""
    if request.param == "compiled":
        reason = cpu_kernel.unavailable()
        if reason is not None and not _compiler_expected():
            pytest.skip(f"compiled CPU kernel unavailable: {reason}")
        monkeypatch.setattr(cpu_kernel, "TILE_ROWS", 4)
    else:
        monkeypatch.setattr(fused, "USE_COMPILED", False)
    monkeypatch.setattr(fused, "BLOCK_ELEMENTS", 1)
    return request.param


def _compiler_expected() -> bool:
    """A C++ compiler and ninja are on PATH (as on every CI machine): the kernel must build."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    return compiler is not None and shutil.which("ninja") is not None


SHAPES = [(1, "none")] + [(n, pad) for n in (7, 129) for pad in ("none", "left", "right", "holes")]


@pytest.mark.parametrize(("n", "padding"), SHAPES)
@pytest.mark.parametrize("gqa", [1, 2])
def test_fused_matches_reference(n, padding, gqa):
    inputs = _inputs(2, 2 * gqa, 2, n, n)
    _assert_matches_reference(inputs, AttentionMask(key_padding=_padding(padding, 2, n)))


@pytest.mark.parametrize("n_new", [1, 5, 20])
@pytest.mark.parametrize("padded", [False, True])
def test_fused_with_a_cache_offset_matches_reference(n_new, padded):
    """Queries at the end of a longer key sequence (chunked prefill, one-token decode)."""
    s = 37
    mask = AttentionMask(key_padding=_padding("left", 2, s) if padded else None)
    mask.query_offset = s - n_new
    _assert_matches_reference(_inputs(2, 4, 2, n_new, s), mask)


@pytest.mark.parametrize("gqa", [1, 2])
def test_one_key_views_with_any_position_stride_match_reference(gqa):
    """A length-1 key axis may carry any stride (a one-token request's keys read out of a paged
    cache, a transposed buffer): ``contiguous()`` leaves such a tensor as it is, so the compiled
    kernel's row check must not depend on it."""
    q1, q2, _, _, _, lam = _inputs(2, 2 * gqa, 2, 1, 1)

    def one_position(width):  # (B, H_kv, 1, width) whose position stride is 1, not width
        return torch.randn(2, 2, width, 1).transpose(2, 3).requires_grad_()

    k1, k2, v = one_position(D), one_position(D), one_position(2 * D)
    assert k1.is_contiguous() and k1.stride(2) == 1
    _assert_matches_reference((q1, q2, k1, k2, v, lam), AttentionMask())


@pytest.mark.parametrize("padding", ["none", "right", "holes"])
@pytest.mark.parametrize("gqa", [1, 2])
@pytest.mark.parametrize("lengths", [[1, 7, 129], [7, 1, 3]], ids=str)
def test_fused_with_packed_documents_matches_reference(lengths, gqa, padding, kernel_path):
    """Documents packed in a row (``document_ids``): the compiled kernel takes them itself."""
    n = sum(lengths)
    documents = torch.cat([torch.full((k,), i) for i, k in enumerate(lengths)])
    documents = torch.stack([documents, documents.flip(0)])  # another layout in row 2
    mask = AttentionMask(key_padding=_padding(padding, 2, n), document_ids=documents)
    assert fused._compiled_kernel_for(torch.zeros(1, device="cpu"), mask) == (
        kernel_path == "compiled"
    )
    _assert_matches_reference(_inputs(2, 2 * gqa, 2, n, n), mask)


def test_fused_with_a_custom_mask_matches_reference():
    n = 23
    allowed = torch.rand(2, 1, n, n) < 0.6
    allowed |= torch.eye(n, dtype=torch.bool)  # every row reads at least itself
    _assert_matches_reference(_inputs(2, 2, 1, n, n), AttentionMask(allowed=allowed))


def test_fused_bf16_forward_is_close():
    inputs = _inputs(2, 4, 2, 129, 129, dtype=torch.bfloat16)
    mask = AttentionMask(key_padding=_padding("left", 2, 129))
    ref, _ = kernels.differential_attention(*inputs, mask, D**-0.5, "reference")
    out, _ = kernels.differential_attention(*inputs, mask, D**-0.5, "fused")
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref) <= 2e-2
    grads = torch.autograd.grad(out.float().sum(), inputs)
    assert all(
        g.dtype == x.dtype and torch.isfinite(g).all() for g, x in zip(grads, inputs, strict=True)
    )


def test_tensor_offsets_give_the_same_result():
    """Fixed-shape decoding passes a 0-d tensor offset; the result and grads are unchanged."""
    inputs = _inputs(1, 4, 2, 1, 9)
    weight = torch.randn(1, 4, 1, 2 * D)
    out, grads = _outputs_and_grads("fused", inputs, AttentionMask(query_offset=8), weight)
    mask = AttentionMask(query_offset=torch.tensor(8))
    out_t, grads_t = _outputs_and_grads("fused", inputs, mask, weight)
    assert _rel(out_t, out) <= 1e-6
    for g, g_ref in zip(grads_t, grads, strict=True):
        assert _rel(g, g_ref) <= 1e-5


@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_decode_step_reads_v_once_and_matches_two_calls(padded):
    """A one-query DIFF V1 call on sdpa takes the single-product formula; it equals the two
    padded SDPA calls it replaces."""
    s = 33
    q1, q2, k1, k2, v, lam = (x.detach() for x in _inputs(2, 4, 2, 1, s))
    mask = AttentionMask(key_padding=_padding("left", 2, s) if padded else None)
    mask.query_offset = s - 1
    two_calls = registry.compose_v1(kernels.sdpa_attention)(q1, q2, k1, k2, v, lam, mask, 0.3)
    once = sdpa_diff_v1(q1, q2, k1, k2, v, lam, mask, 0.3)
    assert _rel(once, two_calls) <= 1e-5
    rows = differential_rows(q1, q2, k1, k2, v, lam, mask, 0.3)
    torch.testing.assert_close(once, rows, rtol=0, atol=0)


def test_no_tensor_as_large_as_one_map(monkeypatch):
    """Forward and backward never hold a (B, H, N, N) tensor: the block maps are R×e."""
    monkeypatch.setattr(fused, "BLOCK_ELEMENTS", 2 * 4 * 128 * 16)
    inputs = _inputs(2, 4, 2, 128, 128)
    with LargestTensor() as seen:
        out = fused.fused_diff_v1(*inputs, AttentionMask(), D**-0.5)
        out.sum().backward()
    one_map = 2 * 4 * 128 * 128
    assert seen.largest <= one_map // 8


def _model(backend: str) -> DiffTransformerLM:
    model = tiny_diffattn("diff_v1", backend=backend)
    with torch.no_grad():  # move λ and norms off their init values
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_whole_model_loss_and_grads_match_reference():
    ids = torch.randint(0, TINY_VOCAB, (2, 37))
    mask = torch.ones(2, 37, dtype=torch.long)
    mask[1, :5] = 0
    results = {}
    for backend in ("reference", "fused"):
        model = _model(backend)
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        results[backend] = (loss, {n: p.grad for n, p in model.named_parameters()})
    (loss_ref, grads_ref), (loss, grads) = results["reference"], results["fused"]
    assert abs(loss.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item())
    assert any("lambda_q1" in name for name in grads)
    for name, g_ref in grads_ref.items():
        assert _rel(grads[name], g_ref) <= 1e-4, name


def test_registry_lists_fused():
    assert "fused" in registry.backend_names()
    backend = registry.get_backend("fused")
    assert backend.diff_v1 is fused.fused_diff_v1 and backend.custom_masks
    assert kernels.resolve_backend("fused", torch.randn(1, 1, 2, 4)) == "fused"


def test_compiled_static_cache_decoding_on_fused_matches_eager():
    """Fixed-shape decoding (tensor offsets, torch.compile) takes the traceable formula."""
    from diffattn.generation import generate

    torch._dynamo.reset()
    model = _model("fused").eval()
    ids = torch.randint(0, TINY_VOCAB, (2, 5))
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    eager = generate(model, ids, mask, max_new_tokens=4, do_sample=False)
    compiled = generate(
        model, ids, mask, max_new_tokens=4, do_sample=False, cache="static", compile=True,
        compile_backend="eager",
    )  # fmt: skip
    assert torch.equal(compiled.sequences, eager.sequences)


def test_blocks_on_worker_threads_equal_blocks_in_order(monkeypatch, kernel_path):
    if kernel_path == "compiled":
        pytest.skip("blocked path only")
    inputs = _inputs(2, 4, 2, 129, 129)
    mask = AttentionMask(key_padding=_padding("left", 2, 129))
    weight = torch.randn(2, 4, 129, 2 * D)
    results, threads = [], torch.get_num_threads()
    torch.set_num_threads(2)  # two workers
    try:
        for parallel in (False, True):
            monkeypatch.setattr(fused, "PARALLEL_BLOCKS", parallel)
            results.append(_outputs_and_grads("fused", inputs, mask, weight))
    finally:
        torch.set_num_threads(threads)
    (out, grads), (out_threads, grads_threads) = results
    torch.testing.assert_close(out_threads, out, rtol=0, atol=0)
    for g, g_ref in zip(grads_threads, grads, strict=True):
        assert _rel(g, g_ref) <= 1e-6


def test_compiled_kernel_builds_where_a_compiler_is(kernel_path):
    """Where a compiler is present the fast path must not fall back silently."""
    if kernel_path == "blocked":
        pytest.skip("checked once")
    if not _compiler_expected():
        pytest.skip("no C++ compiler or ninja on PATH")
    assert cpu_kernel.unavailable() is None


def test_compiled_kernel_can_be_switched_off(monkeypatch, kernel_path):
    if kernel_path == "blocked":
        pytest.skip("checked once")
    monkeypatch.setenv(cpu_kernel.ENV_SWITCH, "0")
    assert "switched off" in cpu_kernel.unavailable()
    assert not fused._compiled_kernel_for(torch.randn(1, 1, 2, 4), AttentionMask())


@pytest.mark.parametrize("tile_rows", [1, 3, 64])
def test_compiled_kernel_tiles_and_threads_agree(monkeypatch, kernel_path, tile_rows):
    """Any tile size and thread count gives the same result; a fixed thread count gives the
    same bits twice (key-side gradients are summed per thread list in a fixed order)."""
    if kernel_path == "blocked":
        pytest.skip("compiled path only")
    inputs = _inputs(2, 6, 2, 129, 129)
    mask = AttentionMask(key_padding=_padding("holes", 2, 129))
    weight = torch.randn(2, 6, 129, 2 * D)
    monkeypatch.setattr(cpu_kernel, "TILE_ROWS", 4)
    out_ref, grads_ref = _outputs_and_grads("fused", inputs, mask, weight)
    monkeypatch.setattr(cpu_kernel, "TILE_ROWS", tile_rows)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n_threads in (1, 2, 2):
            torch.set_num_threads(n_threads)
            runs.append(_outputs_and_grads("fused", inputs, mask, weight))
    finally:
        torch.set_num_threads(threads)
    for out, grads in runs:
        assert _rel(out, out_ref) <= 1e-6
        for g, g_ref in zip(grads, grads_ref, strict=True):
            assert _rel(g, g_ref) <= 1e-5
    (out_a, grads_a), (out_b, grads_b) = runs[1], runs[2]
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


@pytest.mark.parametrize("n_new", [1, 7])
def test_interleaved_cache_views_with_and_without_grad(n_new):
    """K1, K2 as the model passes them (every other head of one cache tensor) and V a slice
    of a longer cache: the result with autograd and the inference path (no autograd node)
    equal ``reference``, and each other bit for bit."""
    s, cache_len = 21, 30
    k_cache = torch.randn(2, 4, cache_len, D)
    v_cache = torch.randn(2, 2, cache_len, 2 * D)
    k1, k2 = k_cache[:, 0::2, :s], k_cache[:, 1::2, :s]
    v = v_cache[:, :, :s]
    q = torch.randn(2, 8, n_new, D)
    q1, q2 = q[:, 0::2], q[:, 1::2]
    lam = torch.tensor(0.37)
    mask = AttentionMask(key_padding=_padding("left", 2, s), query_offset=s - n_new)
    ref = differential_rows(q1, q2, k1, k2, v, lam, mask, D**-0.5)
    with torch.no_grad():
        inference = fused.fused_diff_v1(q1, q2, k1, k2, v, lam, mask, D**-0.5)
    leaves = [t.clone().requires_grad_() for t in (q1, q2, k1, k2, v)]
    with_grad = fused.fused_diff_v1(*leaves, lam, mask, D**-0.5)
    assert _rel(inference, ref) <= 1e-5
    assert torch.equal(with_grad.detach(), inference)


def test_inference_lambda_follows_parameter_updates():
    """λ kept between no-grad calls is recomputed after an in-place update of a λ vector,
    after loading a state dict, and is never reused by a call that needs its gradient."""
    model = _model("reference")
    attn = model.layers[0].attn
    with torch.no_grad():
        first = attn.lambda_full()
        assert attn.lambda_full() is first  # kept
        attn.lambda_q1.add_(0.1)  # as an optimizer step does
        assert torch.equal(attn.lambda_full(), _fresh_lambda(attn))
    state = {k: v + 0.01 if "lambda_k2" in k else v for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(attn.lambda_full(), _fresh_lambda(attn))
    assert attn.lambda_full().requires_grad


def _fresh_lambda(attn):
    from diffattn.attention.diff_v1 import reparameterised_lambda

    return reparameterised_lambda(attn)


def test_compiled_kernel_rejects_a_key_padding_of_the_wrong_width(kernel_path):
    if kernel_path == "blocked":
        pytest.skip("compiled path only")
    q1, q2, k1, k2, v, lam = (x.detach() for x in _inputs(1, 2, 1, 5, 5))
    mask = AttentionMask(key_padding=torch.ones(1, 9, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="key padding must be uint8 of shape"):
        fused.fused_diff_v1(q1, q2, k1, k2, v, lam, mask, D**-0.5)
