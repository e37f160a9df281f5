"""Throughput and time to first token of ``diffattn serve``, baseline vs DIFF V1 vs DIFF V2.

Builds the three types at the same size (random weights, a word-level tokenizer, saved under
``--out``), starts one server per type and batching mode (continuous batching off and on), all
on loopback, and measures them interleaved: every round visits each concurrency level and, in
a rotating order, each server. A client sends streaming ``/v1/completions`` requests of
``--prompt-words`` words for ``--new-tokens`` greedy tokens (EOS never stops them early: the
tokenizer's EOS is taken out of the generation config). Reported per server and concurrency:
the generated tokens per second of all clients together, the median time to first token, and
each DIFF type's throughput as a ratio to the baseline's in the same round (median over
rounds).

With ``--vllm-python PYTHON`` (the interpreter of a venv where vLLM is installed beside
diffattn), the same three checkpoints are also served by ``diffattn serve --engine vllm`` (vLLM's
defaults: torch.compile on, prefix caching and chunked prefill on; 1 GiB of KV cache each) and
measured in the same interleaved rounds; ``--no-plain`` leaves out the transformers servers
without continuous batching.

    PYTHONPATH=src python scripts/bench_serve.py --rounds 2
    PYTHONPATH=src python scripts/bench_serve.py --rounds 3 --no-plain \\
        --vllm-python /path/to/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

TYPES = ("baseline", "diff_v1", "diff_v2")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,4,16", help="concurrency levels (default: 1,4,16)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default: 2)")
    parser.add_argument("--prompt-words", type=int, default=32, help="default: 32")
    parser.add_argument("--new-tokens", type=int, default=32, help="default: 32")
    parser.add_argument("--d-model", type=int, default=256, help="default: 256")
    parser.add_argument("--layers", type=int, default=4, help="default: 4")
    parser.add_argument("--heads", type=int, default=8, help="default: 8")
    parser.add_argument("--out", default=None, help="where the models go (default: a temp dir)")
    parser.add_argument("--no-cb", action="store_true", help="continuous batching off only")
    parser.add_argument(
        "--no-plain", action="store_true", help="leave out transformers serve without batching"
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="also serve with --engine vllm, run by this interpreter (a venv with vLLM)",
    )
    args = parser.parse_args(argv)
    if args.no_cb and args.no_plain and not args.vllm_python:
        parser.error("--no-cb with --no-plain leaves nothing to measure")
    args.client_counts = [int(c) for c in args.clients.split(",")]
    return args


def save_models(args, root: Path) -> dict[str, Path]:
    import torch

    from diffattn import DiffTransformerLM, ModelConfig
    from diffattn.checkpoint import save_model
    from diffattn.presets import match_v2_params
    from serve_helpers import VOCAB, word_tokenizer

    paths = {}
    for attention in TYPES:
        torch.manual_seed(0)
        config = ModelConfig(
            vocab_size=VOCAB,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=args.heads,
            max_seq_len=4 * (args.prompt_words + args.new_tokens),
            attention=attention,
        )
        if attention == "diff_v2":
            # Parameter-matched to the baseline, to the unit: a 64-wide step of this CPU
            # model's SwiGLU is 2% of its parameters (docs/architecture.md, the exemptions).
            config = match_v2_params(config, multiple_of=1)
        model = DiffTransformerLM(config).eval()
        paths[attention] = save_model(
            model, root / attention, tokenizer=word_tokenizer(), overwrite=True
        )
        # generation runs its full length: no EOS in the generation config
        (root / attention / "generation_config.json").write_text('{"eos_token_id": null}')
    return paths


def one_client(client, name: str, prompt: str, new_tokens: int, vllm: bool) -> tuple[float, int]:
    """``(seconds to the first text, completion tokens)`` of one streaming request."""
    start = time.perf_counter()
    first = None
    tokens = 0
    # vLLM streams usage when asked, and stops at the tokenizer's EOS unless told not to
    extra = {"stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
    stream = client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=new_tokens,
        temperature=0,
        stream=True,
        **(extra if vllm else {}),
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first, tokens


def measure(
    server, name: str, clients: int, args, round_index: int, vllm: bool
) -> tuple[float, float]:
    """``(tokens per second of all clients together, median time to first token)``."""
    from serve_helpers import prompt_text, run_concurrently

    jobs = [
        partial(
            one_client,
            server.client(),
            name,
            prompt_text(1000 * round_index + i, args.prompt_words),
            args.new_tokens,
            vllm,
        )
        for i in range(clients)
    ]
    start = time.perf_counter()
    results = run_concurrently(jobs, timeout=600)
    wall = time.perf_counter() - start
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} of {clients} clients failed: {failed[0]!r}")
    short = [t for _, t in results if t != args.new_tokens]
    if short:
        raise RuntimeError(f"{name}: a client got {short[0]} tokens, not {args.new_tokens}")
    return sum(t for _, t in results) / wall, statistics.median(f for f, _ in results)


def main(argv=None) -> int:
    import torch

    from serve_helpers import ServerProcess

    args = parse_args(argv)
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_serve_"))
    root.mkdir(parents=True, exist_ok=True)
    paths = save_models(args, root)
    modes = ([] if args.no_plain else ["off"]) + ([] if args.no_cb else ["continuous"])
    modes += ["vllm"] if args.vllm_python else []
    servers = {}
    try:
        for mode in modes:
            for attention in TYPES:
                log = root / f"{attention}_{mode}.log"
                if mode == "vllm":
                    server = ServerProcess(
                        paths[attention],
                        "--engine",
                        "vllm",
                        log=log,
                        device=None,
                        python=args.vllm_python,
                        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                        start_seconds=900,
                    )
                else:
                    options = ["--continuous-batching", "--cb-num-blocks", "256"]
                    server = ServerProcess(
                        paths[attention], *(options if mode == "continuous" else []), log=log
                    )
                server.warm_up(str(paths[attention]))
                servers[(mode, attention)] = server
        keys = list(servers)
        rows: dict[tuple, list] = {(k, c): [] for k in keys for c in args.client_counts}
        for round_index in range(args.rounds):
            for clients in args.client_counts:
                shift = (round_index + clients) % len(keys)
                for key in keys[shift:] + keys[:shift]:
                    name = str(paths[key[1]])
                    rows[(key, clients)].append(
                        measure(servers[key], name, clients, args, round_index, key[0] == "vllm")
                    )
    finally:
        for server in servers.values():
            server.stop()
    print(
        f"command: PYTHONPATH=src python scripts/bench_serve.py {shlex.join(argv or sys.argv[1:])}"
    )
    print(
        f"models: d_model {args.d_model}, {args.layers} layers, {args.heads} heads; prompts of "
        f"{args.prompt_words} words, {args.new_tokens} new tokens; {args.rounds} rounds; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print()
    print("| server | clients | type | tokens/s | TTFT median (s) | tokens/s vs baseline |")
    print("|---|---|---|---|---|---|")
    labels = {"off": "transformers", "continuous": "transformers, continuous", "vllm": "vLLM"}
    for mode in modes:
        for clients in args.client_counts:
            base = rows[((mode, "baseline"), clients)]
            for attention in TYPES:
                runs = rows[((mode, attention), clients)]
                speed = statistics.median(r[0] for r in runs)
                ttft = statistics.median(r[1] for r in runs)
                ratio = statistics.median(r[0] / b[0] for r, b in zip(runs, base, strict=True))
                print(
                    f"| {labels[mode]} | {clients} | {attention} | {speed:.1f} | {ttft:.3f} | "
                    f"{ratio:.2f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
