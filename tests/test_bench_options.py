"""The options of ``diffattn bench``, pinned: the help text word for word (in option order)
and what each option parses to, so that the argument definitions can be reorganised safely."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from diffattn.bench.throughput import add_arguments

HELP = """\
usage: diffattn bench [-h] [--seq-len SEQ_LEN] [--d-model D_MODEL] [--layers LAYERS]
                      [--head-dim HEAD_DIM] [--kv-heads KV_HEADS] [--vocab VOCAB]
                      [--batch BATCH] [--steps STEPS] [--warmup WARMUP]
                      [--mode {fwd,fwd+bwd,decode,all}] [--prompt-len PROMPT_LEN]
                      [--new-tokens NEW_TOKENS] [--compile] [--mem-seq-len MEM_SEQ_LEN]
                      [--device {cpu,cuda}] [--dtype {fp32,bf16}] [--backend BACKEND]
                      [--peak-tflops PEAK_TFLOPS] [--json] [--no-hf] [--dex]
                      [--models MODELS] [--sweep SWEEP] [--plot PLOT]

options:
  -h, --help            show this help message and exit
  --seq-len SEQ_LEN     tokens per sequence
  --d-model D_MODEL     model width, a multiple of 128 (heads of width 64, paired by V1)
  --layers LAYERS       decoder layers
  --head-dim HEAD_DIM   width of the baseline's heads (default 64); n_heads = d_model /
                        head_dim, and DIFF V1 pairs them
  --kv-heads KV_HEADS   key/value heads (GQA); default d_model/64 (no grouping); DIFF V1
                        needs it even
  --vocab VOCAB         vocabulary size
  --batch BATCH         sequences per step
  --steps STEPS         timed repetitions per mode
  --warmup WARMUP       untimed repetitions first
  --mode {fwd,fwd+bwd,decode,all}
                        what to time: fwd, fwd+bwd, decode or all three (default)
  --prompt-len PROMPT_LEN
                        decode: prompt tokens (default --seq-len)
  --new-tokens NEW_TOKENS
                        decode: tokens generated
  --compile             compile our models as the trainer and generate do (during warmup):
                        every decoder block through torch.compile for fwd and fwd+bwd, and
                        the static-cache decode step (CUDA graphs on CUDA) for decode
  --mem-seq-len MEM_SEQ_LEN
                        measure fwd and fwd+bwd peak memory at this length (default --seq-
                        len)
  --device {cpu,cuda}
  --dtype {fp32,bf16}
  --backend BACKEND     attention backend of the diffattn models: auto or a registered one
                        (diffattn.attention.registry)
  --peak-tflops PEAK_TFLOPS
                        the device's dense peak TFLOP/s in --dtype, for MFU (known GPUs
                        need none)
  --json                print one JSON array of records to stdout (progress to stderr)
  --no-hf               skip the Hugging Face DiffLlama and Llama models
  --dex                 add HF Llama with Dex on half its heads, unmerged and merged
                        (needs transformers)
  --models MODELS       time only these rows (e.g. baseline,hf_llama); a row of ours is an
                        attention type or an ablation of one, spelled as diffattn
                        compare's arms (gda:ratio=1); each row's reference (baseline for
                        ours, hf_llama for HF and Dex rows) must be among them
  --sweep SWEEP         time at each of these sequence lengths (e.g. 512,1024,2048);
                        decode prompts too
  --plot PLOT           write a PNG of tokens/s against sequence length per mode; sweeps
                        512..8192 on CUDA and 256,512,1024 on CPU unless --sweep is given
"""


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffattn bench",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, width=90),
    )
    add_arguments(parser)
    return parser


def test_help_is_pinned():
    help_text = parser().format_help()
    assert help_text.replace("optional arguments:", "options:") == HELP


def test_defaults_are_pinned():
    assert vars(parser().parse_args([])) == {
        "seq_len": 2048,
        "d_model": 512,
        "layers": 4,
        "head_dim": 64,
        "kv_heads": None,
        "vocab": 8192,
        "batch": 1,
        "steps": 3,
        "warmup": 1,
        "mode": "all",
        "prompt_len": None,
        "new_tokens": 64,
        "compile": False,
        "mem_seq_len": None,
        "device": "cpu",
        "dtype": "fp32",
        "backend": "auto",
        "peak_tflops": None,
        "json": False,
        "no_hf": False,
        "dex": False,
        "models": None,
        "sweep": None,
        "plot": None,
    }


def test_every_option_parses_to_its_type():
    argv = "--seq-len 64 --d-model 256 --layers 2 --head-dim 32 --kv-heads 4 --vocab 99 "
    argv += "--batch 3 --steps 4 --warmup 0 --mode decode --prompt-len 9 --new-tokens 5 "
    argv += "--compile --mem-seq-len 33 --device cpu --dtype bf16 --backend sdpa "
    argv += "--peak-tflops 1.5 --json --no-hf --dex --models baseline,,diff_v1 "
    argv += "--sweep 8,16 --plot out/x.png"
    assert vars(parser().parse_args(argv.split())) == dict(
        seq_len=64, d_model=256, layers=2, head_dim=32, kv_heads=4, vocab=99, batch=3,
        steps=4, warmup=0, mode="decode", prompt_len=9, new_tokens=5, compile=True,
        mem_seq_len=33, device="cpu", dtype="bf16", backend="sdpa", peak_tflops=1.5,
        json=True, no_hf=True, dex=True, models=["baseline", "diff_v1"], sweep=[8, 16],
        plot=Path("out/x.png"),
    )  # fmt: skip


@pytest.mark.parametrize("bad", ["--mode all2", "--device tpu", "--dtype fp16", "--sweep 8,x"])
def test_bad_choices_exit_2(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(bad.split())
    assert exit_info.value.code == 2
