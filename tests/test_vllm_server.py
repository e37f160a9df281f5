"""``diffattn serve --engine vllm``: vLLM's OpenAI server on a DIFF V1 checkpoint, driven by the
real ``openai`` client (completions, chat, streaming, 8 concurrent clients), and the models
it refuses before any engine starts (a head width its backend cannot run, a layer of a type
without a vLLM layout, an option it does not know, DiffLlama)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from extras import require_extra
from vllm_helpers import require_vllm

pytestmark = [require_extra("hf"), require_vllm(), pytest.mark.vllm]

from helpers import free_port
from serve_helpers import CHAT_TEMPLATE, VOCAB
from vllm_helpers import greedy, prompt_ids, save_checkpoint

HOST = "127.0.0.1"
START_SECONDS = 240
NEW_TOKENS = 10
SRC = Path(__file__).resolve().parents[1] / "src"


def serve_argv(model: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "diffattn", "serve", str(model), "--engine", "vllm", *options]


def environment() -> dict[str, str]:
    path = os.pathsep.join(filter(None, (str(SRC), os.environ.get("PYTHONPATH"))))
    # vLLM's own multi-process server, whatever tests/test_vllm_engine.py set in this process
    return {
        **os.environ,
        "PYTHONPATH": path,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A DIFF V1 (GQA) checkpoint behind ``diffattn serve --engine vllm``: ``(model, url,
    name)``; stopped with SIGTERM at the end, which must end it within 60 s."""
    directory = tmp_path_factory.mktemp("diff_v1")
    model, _ = save_checkpoint(directory, "diff_v1", n_kv_heads=4)
    port = free_port(HOST)
    log = directory.parent / "vllm-server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            serve_argv(
                directory,
                "--port",
                str(port),
                "--name",
                "diff-v1",
                "--chat-template",
                CHAT_TEMPLATE,
                "--vllm-args=--enforce-eager",
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment(),
        )
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + START_SECONDS
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no /health within {START_SECONDS} s:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    yield model, url, "diff-v1"
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("the server did not stop within 60 s of SIGTERM")


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0, timeout=120)


def complete_ids(client, name: str, prompt: list[int]) -> list[int]:
    response = client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    return list(response.choices[0].model_extra["token_ids"])


def test_the_model_is_listed_under_its_name(server, client):
    assert [m.id for m in client.models.list().data] == ["diff-v1"]


def test_completions_equal_diffattn_greedy(server, client):
    model, _, name = server
    for seed, length in enumerate((1, 7, 140)):
        prompt = prompt_ids(seed, length, VOCAB)
        assert complete_ids(client, name, prompt) == greedy(model, prompt, NEW_TOKENS), length


def test_streamed_text_is_the_completion(server, client):
    _, _, name = server
    prompt = "w1 w2 w3 w4"
    whole = client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    stream = client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(chunks) >= 2
    assert "".join(chunks) == whole.choices[0].text
    assert whole.usage.completion_tokens == NEW_TOKENS


def test_chat_and_streamed_chat_agree(server, client):
    _, _, name = server
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    whole = client.chat.completions.create(
        model=name,
        messages=messages,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model=name,
        messages=messages,
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_eight_concurrent_clients_each_get_diffattns_tokens(server, client):
    model, _, name = server
    prompts = [prompt_ids(50 + i, 5 + 23 * i, VOCAB) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: complete_ids(client, name, p), prompts))
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer == greedy(model, prompt, NEW_TOKENS), len(prompt)


def run_serve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diffattn", "serve", *argv],
        capture_output=True,
        text=True,
        env=environment(),
        timeout=240,
    )


def test_a_head_width_vllm_cannot_run_is_one_line_before_any_engine(tmp_path):
    save_checkpoint(tmp_path, "baseline", head_dim=16, n_heads=8, d_model=128)
    result = run_serve(str(tmp_path), "--engine", "vllm")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "diffattn serve: error: vLLM's CPU_ATTN attention backend cannot serve the baseline "
        "attention of this model: its attention heads have width head_dim = 16, and the backend "
        "supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512"
    )
    assert "Traceback" not in result.stderr + result.stdout


def test_a_layer_whose_type_declares_no_vllm_layout_is_its_reason_before_any_engine(tmp_path):
    """A mixed stack with one layer of a type whose declaration gives a ``vllm_reason``."""
    from diffattn.attention.types import attention_type

    save_checkpoint(tmp_path, "baseline", layer_types="diff_v1,dint")
    result = run_serve(str(tmp_path), "--engine", "vllm")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"diffattn serve: error: vLLM cannot serve attention type 'dint': "
        f"{attention_type('dint').vllm_reason}"
    )
    assert "Traceback" not in result.stderr + result.stdout


def test_an_option_vllm_does_not_know_is_one_line_before_any_engine(tmp_path):
    save_checkpoint(tmp_path, "baseline")
    result = run_serve(
        str(tmp_path), "--engine", "vllm", "--vllm-args=--max-num-seqs 4 --no-such-option"
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "diffattn serve: error: --vllm-args: vLLM's OpenAI server refuses its options: "
        "unrecognized arguments: --no-such-option"
    )
    output = result.stderr + result.stdout
    assert "usage:" not in output and "Traceback" not in output, output[-3000:]


def test_diffllama_is_refused_with_the_way_out(tmp_path):
    from helpers import tiny_hf
    from serve_helpers import word_tokenizer

    tiny_hf("diffllama", vocab_size=VOCAB, hidden_size=128).save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    result = run_serve(str(tmp_path), "--engine", "vllm")
    assert result.returncode == 2
    assert "convert it to a diffattn DIFF V1 directory" in result.stderr
    assert "diffattn convert MODEL OUT" in result.stderr
