"""Fixtures of the multiple-choice tests: native rows of each task, written as jsonl and as a
``save_to_disk`` directory, and tiny models with tokenizers (a Llama whose tokenizer adds a
BOS token, as Llama's does, and a DIFF V1 model whose tokenizer adds none)."""

from __future__ import annotations

import json
from pathlib import Path

ARC_ROWS = [
    {
        "id": f"q{i}",
        "question": question,
        "choices": {"text": choices, "label": ["A", "B", "C", "D"][: len(choices)]},
        "answerKey": key,
    }
    for i, (question, choices, key) in enumerate(
        [
            ("Which is a planet?", ["Mars", "the Moon", "a comet", "Sirius"], "A"),
            ("What melts ice?", ["heat", "cold air", "darkness"], "A"),
            ("Plants make food by", ["eating", "photosynthesis", "sleeping", "x"], "B"),
            ("Water boils at sea level at", ["50 C", "0 C", "100 C", "1000 C"], "C"),
            ("A magnet attracts", ["wood", "glass", "paper", "iron nails"], "D"),
            ("Sound travels fastest in", ["vacuum", "air", "steel"], "C"),
            ("The sun rises in the", ["west", "east"], "B"),
        ]
    )
]
WINOGRANDE_ROWS = [
    {"sentence": s, "option1": a, "option2": b, "answer": ans}
    for s, a, b, ans in [
        ("The cup fell off the table because _ was slippery.", "the cup", "the table", "2"),
        ("Anna gave Maria a gift because _ was kind.", "Anna", "Maria", "1"),
        ("The box did not fit in the car since _ was too big.", "the box", "the car", "1"),
        ("Tom lent Jim money since _ was broke.", "Tom", "Jim", "2"),
    ]
]
BOOLQ_ROWS = [
    {"passage": p, "question": q, "label": label}
    for p, q, label in [
        ("Cats are mammals. They have fur.", "are cats mammals", 1),
        ("The sea is salty.", "is the sea sweet", 0),
        ("Ice is frozen water.", "is ice water", 1),
    ]
]
HELLASWAG_ROW = {
    "ind": 7,
    "activity_label": "Roof shingle removal",
    "ctx_a": "A man is sitting on a roof.",
    "ctx_b": "he",
    "endings": [
        "is using wrap to wrap a pair of skis.",
        "is ripping level tiles off. [title] Step two",
        "is holding a rubik's cube.",
        "starts pulling up roofing on a roof.",
    ],
    "label": "3",
}
COPA_ROW = {
    "premise": "The man turned on the faucet.",
    "choice1": "The toilet filled with water.",
    "choice2": "Water flowed from the spout.",
    "question": "effect",
    "label": 1,
    "idx": 0,
}
TEXT = (
    "Question: Which is a planet?\nAnswer: Mars. The cup fell off the table because it was "
    "slippery. Cats are mammals. Is the sea salty? yes no. Water boils at 100 C.\n\n"
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_save_to_disk(directory: Path, rows: list[dict]) -> Path:
    """A Hugging Face ``save_to_disk`` directory (arrow stream, state.json) of ``rows``."""
    import pyarrow as pa

    directory.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    file = str(directory / "data-00000-of-00001.arrow")
    with pa.OSFile(file, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": "validation"}
    (directory / "state.json").write_text(json.dumps(state))
    (directory / "dataset_info.json").write_text("{}")
    return directory


def build_models(root: Path) -> dict[str, str]:
    """A tiny Llama directory (its tokenizer adds BOS) and a tiny DIFF V1 directory."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from diffattn.checkpoint import save_model
    from diffattn.data import train_bpe
    from helpers import tiny_diffattn, tiny_hf

    bpe = train_bpe([TEXT] * 30, 300, cache_dir=root / "bpe")
    bpe.save(root / "tok")
    raw = Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    eos = "<|endoftext|>"
    raw.post_processor = TemplateProcessing(single=f"{eos} $A", special_tokens=[(eos, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=eos, eos_token=eos)
    llama = tiny_hf("llama", vocab_size=bpe.vocab_size, max_position_embeddings=128)
    llama.save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    diff = tiny_diffattn("diff_v1", vocab_size=bpe.vocab_size, max_seq_len=128)
    save_model(diff, root / "diff_v1", tokenizer=bpe)
    return {"llama": str(root / "llama"), "diff_v1": str(root / "diff_v1")}
