"""Dex, the differential extension of pretrained decoders (Kong, Jang, Kwak; paper 003).

For selected heads h of every layer, O'_h = O_h − λ(t)·O_h W_D,h (Eq.3–5) before W_O, with
the annealed λ(t) of Eq.4, head selection by attention entropy or importance (§3.2), an exact
merge into W_O, adapter files and the effective-attention analysis of App. F.3.

```python
from diffattn import dex

selection = dex.select_heads(model, calibration_ids, method="entropy")   # top half, high first
dex.apply(model, selection, anneal_steps=1000)           # λ(0) = 0: outputs unchanged
optimizer = torch.optim.AdamW(dex.trainable_parameters(model), lr=1e-4)
for batch in data:                                        # your loop
    model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
    dex.step(model)                                       # advance t of Eq.4
dex.save_adapter(model, "dex-adapter")
dex.merge(model).save_pretrained("merged")                # plain checkpoint
```

See ``docs/dex.md``.
"""

from typing import Any

from diffattn.dex.adapter import (
    apply,
    dex_layers,
    freeze,
    is_dex,
    named_trainable_parameters,
    selected_heads,
    trainable_parameters,
)
from diffattn.dex.effective import (
    HeadTensors,
    agreement,
    attention_to_answer,
    effective_attention,
    effective_attention_nearest,
    effective_attention_optim,
    effective_attention_pinv,
    head_tensors,
)
from diffattn.dex.io import load_adapter, read_adapter_config, save_adapter
from diffattn.dex.layer import DexHeads
from diffattn.dex.merge import fold_into_o_proj, merge
from diffattn.dex.schedule import (
    get_step,
    lambda_schedule,
    lambdas,
    set_step,
    step,
    trainer_callback,
)
from diffattn.dex.selection import (
    HeadSelection,
    attention_entropy,
    head_importance,
    select_heads,
)
from diffattn.dex.sites import AttentionSite, find_attention


def __getattr__(name: str) -> Any:
    if name == "DexCallback":  # a transformers.TrainerCallback, built on first use
        from diffattn.dex.schedule import _callback_class

        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AttentionSite",
    "DexCallback",
    "DexHeads",
    "HeadSelection",
    "HeadTensors",
    "agreement",
    "apply",
    "attention_entropy",
    "attention_to_answer",
    "dex_layers",
    "effective_attention",
    "effective_attention_nearest",
    "effective_attention_optim",
    "effective_attention_pinv",
    "find_attention",
    "fold_into_o_proj",
    "freeze",
    "get_step",
    "head_importance",
    "head_tensors",
    "is_dex",
    "lambda_schedule",
    "lambdas",
    "load_adapter",
    "merge",
    "named_trainable_parameters",
    "read_adapter_config",
    "save_adapter",
    "select_heads",
    "selected_heads",
    "set_step",
    "step",
    "trainable_parameters",
    "trainer_callback",
]
