"""Tiny served models and a real ``diffattn serve`` subprocess for the serving tests.

Every model shares one word-level tokenizer (``w0`` ... ``w125``, ``<eos>``, ``<unk>``) whose
tokens decode to whole words, so a streamed completion, joined, is exactly the decoded one.
Servers listen on a free loopback port; every wait is bounded.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from helpers import free_port

SRC = Path(__file__).resolve().parents[1] / "src"
HOST = "127.0.0.1"
WORDS = 126
VOCAB = WORDS + 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
"""A chat template over the tokenizer's own words (roles are unknown words: ``<unk>``)."""
START_SECONDS = 120
STOP_SECONDS = 30
WARM_UP_SECONDS = 600


def word_tokenizer():
    """A fast word-level tokenizer of :data:`VOCAB` tokens, ``<eos>`` as its EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(WORDS)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")


def prompt_text(seed: int, words: int) -> str:
    """A prompt of ``words`` words, different per ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, WORDS, (words,), generator=generator).tolist()
    return " ".join(f"w{i}" for i in ids)


def save_tiny_model(kind: str, directory: Path, max_seq_len: int = 96, seed: int = 0) -> Path:
    """A tiny model of ``kind`` (an attention type, or ``llama`` for a Hugging Face Llama,
    as a Dex-merged or converted checkpoint is) saved with the word tokenizer."""
    from diffattn.checkpoint import save_model
    from helpers import tiny_diffattn, tiny_hf

    tokenizer = word_tokenizer()
    if kind == "llama":
        model = tiny_hf("llama", seed=seed, vocab_size=VOCAB, max_position_embeddings=max_seq_len)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        return directory
    model = tiny_diffattn(kind, seed=seed, vocab_size=VOCAB, max_seq_len=max_seq_len)
    return save_model(model, directory, tokenizer=tokenizer)


def port_is_free(port: int) -> bool:
    """Whether a new server could listen on ``port`` now (as uvicorn binds: with
    ``SO_REUSEADDR``, so closed connections in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


class ServerProcess:
    """``python -m diffattn serve MODEL --host 127.0.0.1 --port P ...`` as a subprocess."""

    def __init__(
        self,
        model: Path | str,
        *options: str,
        log: Path,
        python: str = sys.executable,
        device: str | None = "cpu",
        env: dict[str, str] | None = None,
        start_seconds: float = START_SECONDS,
    ) -> None:
        """``python``: the interpreter that runs diffattn (another venv's, for vLLM);
        ``device``: ``--device`` (``None``: not given, as ``--engine vllm`` wants); ``env``:
        more environment variables."""
        self.port = free_port(HOST)
        self.url = f"http://{HOST}:{self.port}"
        self.log = log
        self.start_seconds = start_seconds
        env = {
            **os.environ,
            **(env or {}),
            "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        argv = [python, "-m", "diffattn", "serve", str(model), "--host", HOST]
        argv += ["--port", str(self.port), *(["--device", device] if device else []), *options]
        self._log_file = open(log, "wb")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            argv, stdout=self._log_file, stderr=subprocess.STDOUT, env=env
        )
        self._wait_until_healthy()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.start_seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode}:\n{self.output()}"
                )
            try:
                if self.request("GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy within {self.start_seconds} s:\n{self.output()}")

    def request(self, method: str, path: str, body: bytes | dict | None = None, timeout=60):
        """``(status, parsed JSON body)`` of one plain HTTP request."""
        connection = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            headers = {"content-type": "application/json"} if data is not None else {}
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            connection.close()

    def hang_up_mid_stream(self, path: str, body: dict) -> None:
        """Start a streaming request, read its first event, and close the connection."""
        connection = http.client.HTTPConnection(HOST, self.port, timeout=60)
        try:
            connection.request(
                "POST", path, body=json.dumps(body), headers={"content-type": "application/json"}
            )
            response = connection.getresponse()
            assert response.status == 200, response.read()
            assert response.readline().startswith(b"data: ")
        finally:
            connection.close()

    def warm_up(self, name: str) -> None:
        """One short request, so first-use costs (building the CPU DIFF V1 kernel on a fresh
        machine) stay out of the timed requests."""
        self.client(timeout=WARM_UP_SECONDS).completions.create(
            model=name, prompt="w1 w2", max_tokens=2, temperature=0
        )

    def client(self, timeout: float = 180.0):
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="none", timeout=timeout, max_retries=0
        )

    def stop(self) -> int:
        """SIGTERM, then wait (bounded); returns the exit code (killed: -9)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_SECONDS)
        self._log_file.close()
        return self.process.returncode


class Reference:
    """The served model loaded as the server loads it, for greedy ``generate`` answers."""

    def __init__(
        self,
        model_dir: Path | str,
        chat_template: str | None = None,
        backend: str | None = None,
        base: str | None = None,
    ) -> None:
        from diffattn.serve.model import ServedModelLoader
        from diffattn.serve.options import parse_options

        options = parse_options(
            str(model_dir), device="cpu", chat_template=chat_template, backend=backend, base=base
        )
        loader = ServedModelLoader(options)
        self.model = loader.load_model()
        self.tokenizer = loader.load_tokenizer()

    def tokens(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(prompt_ids) :].tolist()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def completion(self, prompt: str, max_new_tokens: int) -> str:
        """The text ``/v1/completions`` should answer greedily."""
        return self.decode(self.tokens(self.tokenizer(prompt)["input_ids"], max_new_tokens))

    def chat(self, messages: list[dict], max_new_tokens: int) -> str:
        """The text ``/v1/chat/completions`` should answer greedily."""
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        return self.decode(self.tokens(list(ids), max_new_tokens))


def run_concurrently(jobs: list[Callable[[], object]], timeout: float) -> list[object]:
    """Run every job in its own thread at once; their results in order (an exception raised by
    a job is its result). A job still running after ``timeout`` seconds is an error."""
    results: list[object] = [None] * len(jobs)

    def run(index: int) -> None:
        try:
            results[index] = jobs[index]()
        except Exception as error:  # returned as the job's result, to be reported
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    late = [i for i, thread in enumerate(threads) if thread.is_alive()]
    if late:
        raise TimeoutError(f"jobs {late} did not finish within {timeout} s")
    return results
