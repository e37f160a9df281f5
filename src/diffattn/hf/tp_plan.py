"""The tensor-parallel plan of ``DiffAttnForCausalLM`` for Hugging Face's ``tp_plan="auto"``.

The styles are transformers' names; the rules follow the split of
:mod:`diffattn.train.tensor_parallel`: attention by KV groups (the projections' contiguous
output rows are whole groups in all three types, DIFF V1's (Q1, Q2) / (K1, K2) half-heads and
width-2d V heads and DIFF V2's head pairs included), ``W_O`` and the FFN's ``down_proj``
row-parallel, the embedding split by vocabulary and the LM head's logits gathered. DIFF V2's
``W_λ`` is split by output head, beside the pair each λ weights (the rule matches nothing in
the other two types). DIFF V1's λ vectors and per-head norm weight are not in the plan: every
rank keeps them whole, and the per-head norm reads the rank's local heads. The modules take
their head counts from the projections' output sizes, so every backend runs on the local heads.

A degree that does not divide the KV groups or the FFN width cannot split these rules;
:func:`diffattn.train.tensor_parallel.tp_problem` names the reason.
"""

from __future__ import annotations

TP_PLAN: dict[str, str] = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.attn.q_proj": "colwise",
    "model.layers.*.attn.k_proj": "colwise",
    "model.layers.*.attn.v_proj": "colwise",
    "model.layers.*.attn.lambda_proj": "colwise",
    "model.layers.*.attn.o_proj": "rowwise",
    "model.layers.*.ffn.gate_proj": "colwise",
    "model.layers.*.ffn.up_proj": "colwise",
    "model.layers.*.ffn.down_proj": "rowwise",
    "model.lm_head": "colwise_gather_output",
}
