"""Load ``convert --to hub`` directories twice in one process, fine-tune, save, reload elsewhere.

``python hub_resave_check.py save WORK_DIR OUT_JSON HUB_DIR... [--block-diffattn |
--import-diffattn]`` loads each directory's config twice with ``AutoConfig`` and its model
twice with ``AutoModelForCausalLM`` (``trust_remote_code=True``), then writes into
``WORK_DIR/<name>/<name>-<kind>`` (each saved directory named apart: transformers names
the module of remote code after its directory), for each ``<kind>``:

* ``first``: ``save_pretrained`` of the first model, as loaded;
* ``trained``: the second model after one training step of ``transformers.Trainer``
  (``learning_rate`` 0.01, CPU), saved by ``Trainer.save_model`` with the tokenizer;
* ``config``: ``save_pretrained`` of the second config alone;
* ``vendored``, when the models are those of ``modeling_diffattn.py``: the class they subclass
  (the copy of diffattn unpacked from the file, which no Auto class returns) loaded with its own
  ``from_pretrained`` and saved.

``python hub_resave_check.py load WORK_DIR OUT_JSON [--block-diffattn]``, run in a fresh process,
loads each of them back with ``trust_remote_code=True``. Both write a JSON report per directory:
the classes, the files of each saved directory (save), the logits of one prompt of each model,
the tokenizer's ids of the prompts, the config's fields and (load) the config class's error
for an unknown argument. ``--block-diffattn`` makes every import of diffattn fail (for an
interpreter where it is installed); ``--import-diffattn`` imports it before loading, so
transformers knows diffattn's own classes; with neither, diffattn must be absent.

An interpreter without ``accelerate``, which ``Trainer`` needs (the hub venv of ``.ci/run``
has torch and transformers only), takes the same step with ``torch.optim.AdamW`` and saves with
``save_pretrained``; the report says which (``fine_tuned_with``). This file imports nothing of
diffattn or of the test helpers except ``hub_remote_check``, which imports none either.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

from hub_remote_check import PROMPTS, diffattn_modules, guard_diffattn

LEARNING_RATE = 0.01
MODELS = ("first", "trained", "vendored")
"""The model directories the save phase may write (besides ``config``)."""


def class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__name__}"


def prompt_logits(model, tokenizer) -> list:
    """The logits of the first prompt, unpadded, in eval mode."""
    import torch

    ids = tokenizer(PROMPTS[:1], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model.eval()(ids).logits[0].tolist()


def training_rows(tokenizer) -> list[dict]:
    """The prompts as padded rows with labels (padding ignored)."""
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return [
        {"input_ids": ids, "attention_mask": mask, "labels": label}
        for ids, mask, label in zip(
            batch["input_ids"], batch["attention_mask"], labels, strict=True
        )
    ]


def fine_tune_and_save(model, tokenizer, out_dir: str) -> str:
    """One training step on the prompts, then save ``model`` and ``tokenizer`` to ``out_dir``;
    ``"Trainer"`` or ``"AdamW"``, whichever took the step."""
    rows = training_rows(tokenizer)
    if importlib.util.find_spec("accelerate") is None:
        import torch

        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        batch = {k: torch.stack([row[k] for row in rows]) for k in rows[0]}
        model.train()(**batch).loss.backward()
        optimizer.step()
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        return "AdamW"
    from transformers import Trainer, TrainingArguments, default_data_collator

    with tempfile.TemporaryDirectory() as scratch:
        arguments = TrainingArguments(
            output_dir=scratch,
            max_steps=1,
            per_device_train_batch_size=len(rows),
            learning_rate=LEARNING_RATE,
            lr_scheduler_type="constant",
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=arguments,
            train_dataset=rows,
            data_collator=default_data_collator,
            processing_class=tokenizer,
        )
        trainer.train()
        trainer.save_model(out_dir)
    return "Trainer"


def vendored_class(model) -> type | None:
    """The ``DiffAttnForCausalLM`` of the copy of diffattn that ``model``'s class subclasses
    (``_diffattn_<hash>.hf.modeling``), if it has one."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("_diffattn_") and cls.__name__ == "DiffAttnForCausalLM":
            return cls
    return None


def config_fields(config) -> dict:
    """The config's fields, less those that name where or with what it was saved."""
    data = config.to_dict()
    return {k: v for k, v in data.items() if k not in ("_name_or_path", "transformers_version")}


def saved_path(work_dir: str, kind: str) -> str:
    """Where the save phase writes ``kind`` (``first``, ``trained``, ``config``)."""
    name = os.path.basename(os.path.normpath(work_dir))
    return os.path.join(work_dir, f"{name}-{kind}")


def save_one(hub_dir: str, work_dir: str) -> dict:
    """The save phase for one Hub directory (module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    configs = [AutoConfig.from_pretrained(hub_dir, trust_remote_code=True) for _ in range(2)]
    models = [
        AutoModelForCausalLM.from_pretrained(hub_dir, trust_remote_code=True) for _ in range(2)
    ]
    tokenizer = AutoTokenizer.from_pretrained(hub_dir, trust_remote_code=True)
    report = {
        "config_classes": [class_name(c) for c in configs],
        "model_classes": [class_name(m) for m in models],
        "logits": {"first": prompt_logits(models[0], tokenizer)},
        "token_ids": tokenizer(PROMPTS)["input_ids"],
        "config": config_fields(configs[1]),
    }
    paths = {kind: saved_path(work_dir, kind) for kind in ("first", "trained", "config")}
    models[0].save_pretrained(paths["first"])
    vendored = vendored_class(models[0])
    if vendored is not None:
        paths["vendored"] = saved_path(work_dir, "vendored")
        model = vendored.from_pretrained(hub_dir)
        report["logits"]["vendored"] = prompt_logits(model, tokenizer)
        model.save_pretrained(paths["vendored"])
    report["fine_tuned_with"] = fine_tune_and_save(models[1], tokenizer, paths["trained"])
    report["logits"]["trained"] = prompt_logits(models[1], tokenizer)
    configs[1].save_pretrained(paths["config"])
    report["files"] = {kind: sorted(os.listdir(path)) for kind, path in paths.items()}
    return report


def load_one(work_dir: str) -> dict:
    """The load phase for what :func:`save_one` wrote into ``work_dir`` (module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    trained = saved_path(work_dir, "trained")
    tokenizer = AutoTokenizer.from_pretrained(trained, trust_remote_code=True)
    report = {"logits": {}, "model_classes": {}, "token_ids": tokenizer(PROMPTS)["input_ids"]}
    for kind in MODELS:
        path = saved_path(work_dir, kind)
        if not os.path.isdir(path):
            continue
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
        report["model_classes"][kind] = class_name(model)
        report["logits"][kind] = prompt_logits(model, tokenizer)
    config = AutoConfig.from_pretrained(saved_path(work_dir, "config"), trust_remote_code=True)
    report["config_class"] = class_name(config)
    report["config"] = config_fields(config)
    try:  # diffattn's constructor refuses an argument it does not know
        type(config)(not_a_setting=1)
        report["refused"] = None
    except ValueError as error:
        report["refused"] = str(error)
    return report


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("phase", choices=("save", "load"))
    parser.add_argument("work_dir")
    parser.add_argument("out_json")
    parser.add_argument("hub_dirs", nargs="*", help="save: the Hub directories")
    diffattn = parser.add_mutually_exclusive_group()
    diffattn.add_argument("--block-diffattn", action="store_true")
    diffattn.add_argument("--import-diffattn", action="store_true")
    args = parser.parse_args(argv)
    if (args.phase == "save") != bool(args.hub_dirs):
        parser.error("save takes one or more HUB_DIRs, load takes none")
    return args


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.import_diffattn:
        import diffattn  # noqa: F401  (registers its classes with the Auto classes)
    else:
        guard_diffattn(block=args.block_diffattn)
    if args.phase == "save":
        directories = {}
        for hub_dir in args.hub_dirs:
            name = os.path.basename(os.path.normpath(hub_dir))
            directories[name] = save_one(hub_dir, os.path.join(args.work_dir, name))
    else:
        names = sorted(os.listdir(args.work_dir))
        directories = {name: load_one(os.path.join(args.work_dir, name)) for name in names}
    report = {"directories": directories}
    if not args.import_diffattn:
        report["diffattn_modules"] = diffattn_modules()
    with open(args.out_json, "w", encoding="utf-8") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1:])
