"""Load a ``convert --to hub`` directory as a user without diffattn would, and report.

``python hub_remote_check.py HUB_DIR OUT_JSON [--block-diffattn] [--block NAME]...`` runs in any
interpreter that has torch and transformers. With ``--block-diffattn`` every import of diffattn
fails (for an interpreter where it is installed); without it diffattn must be absent. Each
``--block NAME`` makes the imports of the package ``NAME`` fail too (the package of an attention
type that the export carries). It loads the model and
tokenizer with ``trust_remote_code=True``, pads a batch with the tokenizer, and writes to
OUT_JSON: the logits of one prompt, the padded batch's greedy continuation through ``generate``
(HF's cache), and the logits again after ``save_pretrained`` and a second load. This file
imports nothing of diffattn or of the test helpers.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import sys
import tempfile

PROMPTS = ["w3 w17 w5 w99 w1 w42 w7", "w8 w2"]


class _Blocked(importlib.abc.MetaPathFinder):
    def __init__(self, packages):
        self.packages = tuple(packages)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.packages:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


def guard_diffattn(block: bool, others=()) -> None:
    """Make every later import of diffattn fail (``block``), or exit when diffattn is
    importable here; imports of the packages ``others`` fail as well."""
    if block or others:
        sys.meta_path.insert(0, _Blocked((*(["diffattn"] * block), *others)))
    if not block and importlib.util.find_spec("diffattn") is not None:
        sys.exit("diffattn is installed here; pass --block-diffattn")


def diffattn_modules() -> list[str]:
    """The modules of diffattn itself (not its vendored copy) imported in this process."""
    return sorted(n for n in sys.modules if n == "diffattn" or n.startswith("diffattn."))


def main(hub_dir: str, out_json: str, block: bool, others=()) -> None:
    guard_diffattn(block, others)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hub_dir, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(hub_dir, padding_side="left")
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(batch["input_ids"][:1]).logits[0]
        generated = model.generate(**batch, max_new_tokens=6, do_sample=False)
    with tempfile.TemporaryDirectory() as again:
        model.save_pretrained(again)
        reloaded = AutoModelForCausalLM.from_pretrained(again, trust_remote_code=True).eval()
        with torch.no_grad():
            reloaded_logits = reloaded(batch["input_ids"][:1]).logits[0]
    report = {
        "model_class": f"{type(model).__module__}.{type(model).__name__}",
        "diffattn_modules": diffattn_modules(),
        "pad_token": tokenizer.pad_token,
        "input_ids": batch["input_ids"].tolist(),
        "attention_mask": batch["attention_mask"].tolist(),
        "logits": logits.tolist(),
        "generated": generated.tolist(),
        "reloaded_logits": reloaded_logits.tolist(),
    }
    with open(out_json, "w", encoding="utf-8") as f:
        json.dump(report, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hub_dir")
    parser.add_argument("out_json")
    parser.add_argument("--block-diffattn", action="store_true")
    parser.add_argument("--block", action="append", default=[], metavar="NAME")
    options = parser.parse_args()
    main(options.hub_dir, options.out_json, options.block_diffattn, options.block)
