"""``diffattn eval hallucination``: LongBench-format data, prompts, the judge prompt and its
parsing, the HTTP judge against a fake OpenAI-compatible server of our own on 127.0.0.1, the
local-model judge, the experiment and the command line."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from diffattn.cli import main
from diffattn.eval import hallucination, judge
from diffattn.eval.common import TextTokenizer, load_models
from helpers import tiny_diffattn

MAX_REQUESTS = 200


class FakeJudge(ThreadingHTTPServer):
    """A chat-completions endpoint on loopback. Verdict rule: ``YES`` when the model output
    has an even number of characters, else ``NO``; ``script`` holds what the next requests
    get instead (an HTTP status, ``"garbage"``, ``"slow"``, ``"broken"``)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.requests: list[dict] = []
        self.headers_seen: list[dict] = []
        self.script: list = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


def verdict_rule(output: str) -> bool:
    return len(output) % 2 == 0


class FakeHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        server = self.server
        if len(server.requests) >= MAX_REQUESTS:
            self.send_error(503, "request budget of the fake judge spent")
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.requests.append(body)
        server.headers_seen.append(dict(self.headers))
        action = server.script.pop(0) if server.script else None
        if isinstance(action, int):
            self.send_error(action)
            return
        if action == "slow":
            time.sleep(1.0)
        if self.path != "/v1/chat/completions":
            self.send_error(404)
            return
        user = body["messages"][-1]["content"]
        output = user.split("Model output:\n", 1)[1].split("\n\nIs the model output", 1)[0]
        output = "" if output == "(empty)" else output
        content = "YES." if verdict_rule(output) else "No, it is not."
        if action == "garbage":
            content = "I cannot tell."
        payload = {"choices": [{"message": {"role": "assistant", "content": content}}]}
        if action == "broken":
            payload = {"nothing": True}
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_judge():
    server = FakeJudge()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def longbench(tmp_path):
    """Two LongBench-format files: QA (with input) and summarization (no input)."""
    data = tmp_path / "longbench"
    data.mkdir()
    qa = [
        {
            "input": f"What is the code of box {i}?",
            "context": f"Box {i} holds the code {1000 + i}. " + "Filler text. " * 30,
            "answers": [str(1000 + i)],
            "_id": f"q{i}",
        }
        for i in range(5)
    ]
    summaries = [
        {"input": "", "context": f"The river {i} rose after rain. " * 10, "answers": ["Rain."]}
        for i in range(3)
    ]
    _write(data / "hotpotqa.jsonl", qa)
    _write(data / "xsum.jsonl", summaries)
    return data


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from diffattn.checkpoint import save_model
    from diffattn.data import train_bpe

    tmp = tmp_path_factory.mktemp("hallucination")
    text = [hallucination.QA_TEMPLATE, hallucination.SUMMARY_TEMPLATE, "Box 1 holds 1001. YES NO"]
    text += [judge.JUDGE_SYSTEM, judge.JUDGE_TEMPLATE]
    tok = train_bpe(text * 5, 600, cache_dir=tmp / "cache")
    model = tiny_diffattn("diff_v2", vocab_size=tok.vocab_size, max_seq_len=256)
    return save_model(model, tmp / "diff_v2", tokenizer=tok)


# --- judge prompt and parsing -----------------------------------------------------------------


@pytest.mark.parametrize(
    "reply, verdict",
    [
        ("YES", True),
        ("yes.", True),
        ("No, it is not.", False),
        ("NO", False),
        ("Answer: NO because ... yes", False),
        ("nobody knows", None),
        ("YESNO", None),
        ("", None),
    ],
)
def test_parse_verdict(reply, verdict):
    assert judge.parse_verdict(reply) is verdict


def test_judge_prompt_holds_everything():
    prompt = judge.judge_prompt("D" * 100, "Why?", ["a", "b"], "out", "qa", document_chars=40)
    assert "Question:\nWhy?" in prompt and "- a\n- b" in prompt and "Model output:\nout" in prompt
    document = prompt.split("Source document:\n", 1)[1].split("\n\n", 1)[0]
    assert len(document) <= 40 and document.startswith("D") and "[…]" in document
    summary = judge.judge_prompt("doc", "", ["s"], "", "summarization")
    assert "Question" not in summary and "Reference summary" in summary and "(empty)" in summary


# --- data and prompts -------------------------------------------------------------------------


def test_load_samples(longbench, tmp_path):
    data = hallucination.load_samples([str(longbench)], samples=4, seed=1)
    assert list(data) == ["hotpotqa", "xsum"]
    assert len(data["hotpotqa"]) == 4 and len(data["xsum"]) == 3
    assert {s.task for s in data["hotpotqa"]} == {"qa"}
    assert {s.task for s in data["xsum"]} == {"summarization"}
    again = hallucination.load_samples([str(longbench)], samples=4, seed=1)
    assert again == data
    forced = hallucination.load_samples([str(longbench / "xsum.jsonl")], task="qa")
    assert forced["xsum"][0].task == "qa"
    _write(tmp_path / "bad.jsonl", [{"input": "q", "answers": ["a"]}])
    with pytest.raises(ValueError, match="needs a string 'context'"):
        hallucination.load_samples([str(tmp_path / "bad.jsonl")])
    with pytest.raises(ValueError, match="no such file"):
        hallucination.load_samples([str(tmp_path / "missing.jsonl")])


def test_prompt_keeps_head_and_tail_of_long_contexts(model_dir):
    tokenizer = load_models([str(model_dir)])[0].tokenizer
    sample = hallucination.Sample("d", "qa", "Box 1 holds 1001. " * 50, "What?", ("1001",))
    full = hallucination.build_prompt(sample, tokenizer, 10_000)
    cut = hallucination.build_prompt(sample, tokenizer, 100)
    assert len(cut) == 100 < len(full)
    head_text, tail_text = hallucination.QA_TEMPLATE.split("{context}")
    head = len(tokenizer.encode(head_text, special=True))
    tail = len(tokenizer.encode(tail_text.format(question="What?")))
    room = 100 - head - tail
    kept_head, kept_tail = head + room // 2, tail + room - room // 2
    assert cut[:kept_head] == full[:kept_head] and cut[-kept_tail:] == full[-kept_tail:]
    assert tokenizer.decode(full).endswith("Question: What?\nAnswer:")
    with pytest.raises(ValueError, match="no room for the context"):
        hallucination.build_prompt(sample, tokenizer, 5)
    assert hallucination.clean_output(" a b\n\nc", "\n\n") == "a b"


# --- the HTTP judge ---------------------------------------------------------------------------


def test_http_judge_replies_retries_and_fails_clearly(fake_judge):
    client = judge.HTTPJudge(fake_judge.url, "judge-model", api_key="k", timeout=5, backoff=0.01)
    assert client.url.endswith("/v1/chat/completions")
    prompt = judge.judge_prompt("doc", "q", ["a"], "ab", "qa")
    assert judge.parse_verdict(client.reply(prompt)) is True
    sent = fake_judge.requests[-1]
    assert sent["model"] == "judge-model" and sent["temperature"] == 0
    assert sent["messages"][0]["content"] == judge.JUDGE_SYSTEM
    assert fake_judge.headers_seen[-1]["Authorization"] == "Bearer k"
    fake_judge.script = [503, 500]  # two failures, then an answer
    before = len(fake_judge.requests)
    assert judge.parse_verdict(client.reply(prompt)) is True
    assert len(fake_judge.requests) - before == 3
    fake_judge.script = [503, 503, 503, 503]
    with pytest.raises(ValueError, match="no answer after 3 attempts"):
        client.reply(prompt)
    fake_judge.script = [400]
    before = len(fake_judge.requests)
    with pytest.raises(ValueError, match="HTTP 400"):
        client.reply(prompt)
    assert len(fake_judge.requests) - before == 1  # no retry on a client error
    fake_judge.script = ["broken"]
    with pytest.raises(ValueError, match="not a chat-completions reply"):
        client.reply(prompt)
    fake_judge.script = []


def test_http_judge_timeout_is_bounded(fake_judge):
    client = judge.HTTPJudge(fake_judge.url, "m", timeout=0.2, attempts=2, backoff=0.01)
    fake_judge.script = ["slow", "slow"]
    start = time.perf_counter()
    with pytest.raises(ValueError, match="no answer after 2 attempts"):
        client.reply("Model output:\nx\n\nIs the model output")
    assert time.perf_counter() - start < 5


def test_http_judge_from_environment(monkeypatch):
    monkeypatch.delenv(judge.ENV_URL, raising=False)
    with pytest.raises(ValueError, match="DIFFATTN_JUDGE_URL"):
        judge.HTTPJudge.from_env()
    monkeypatch.setenv(judge.ENV_URL, "ftp://127.0.0.1/")
    monkeypatch.setenv(judge.ENV_MODEL, "m")
    with pytest.raises(ValueError, match="http"):
        judge.HTTPJudge.from_env()


# --- the experiment ---------------------------------------------------------------------------

TINY = dict(samples=3, max_new_tokens=6, max_input_tokens=120, batch_size=2, seed=0)


def test_run_with_the_fake_judge(model_dir, longbench, fake_judge, one_thread):
    models = load_models([str(model_dir)])
    client = judge.HTTPJudge(fake_judge.url, "m", timeout=10, backoff=0.01)
    fake_judge.script = [None, "garbage"]  # the second verdict is unparsed
    results = hallucination.run(models, client, data=[str(longbench)], **TINY)
    r = results["models"]["diff_v2"]
    assert set(r["datasets"]) == {"hotpotqa", "xsum"}
    assert len(fake_judge.requests) == 6
    unparsed = 0
    for d in r["datasets"].values():
        expected = [verdict_rule(i["output"]) for i in d["items"] if i["verdict"] is not None]
        assert [i["verdict"] for i in d["items"] if i["verdict"] is not None] == expected
        p = sum(expected) / len(expected)
        assert d["accuracy"] == pytest.approx(p) and d["n"] == len(expected)
        assert d["stderr"] == pytest.approx(math.sqrt(p * (1 - p) / len(expected)))
        unparsed += d["unparsed"]
    assert unparsed == 1
    # Outputs are the greedy continuations of the prompts, cut at the stop string.
    sample = hallucination.load_samples([str(longbench)], samples=3, seed=0)["hotpotqa"][0]
    tokenizer = models[0].tokenizer
    ids = torch.tensor([hallucination.build_prompt(sample, tokenizer, 120)])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, models[0].model(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
    text = tokenizer.decode(ids[0, -6:].tolist())
    assert r["datasets"]["hotpotqa"]["items"][0]["output"] == hallucination.clean_output(
        text, "\n\n"
    )
    assert "Table 4" in hallucination.report(results)


def test_local_judge(model_dir, one_thread):
    model = load_models([str(model_dir)])[0]
    local = judge.LocalJudge(model)
    prompt = judge.judge_prompt("doc", "q", ["a"], "b", "qa")
    reply = local.reply(prompt)
    tokenizer: TextTokenizer = model.tokenizer
    ids = tokenizer.encode(f"{judge.JUDGE_SYSTEM}\n\n{prompt}{local.SUFFIX}", special=True)
    scores = {}
    for word in ("YES", "NO"):
        seq = tokenizer.encode(f" {word}")
        full = torch.tensor([ids + seq])
        with torch.no_grad():
            logprobs = torch.log_softmax(model.model(input_ids=full).logits[0].double(), -1)
        scores[word] = sum(float(logprobs[len(ids) - 1 + j, t]) for j, t in enumerate(seq))
    assert len(ids) + 2 < 256 and reply == max(scores, key=scores.get)
    long_prompt = judge.judge_prompt("Box 1 holds 1001. " * 200, "q", ["a"], "b", "qa")
    assert local.reply(long_prompt) in ("YES", "NO")  # cut to the model's context


def test_command_line(model_dir, longbench, fake_judge, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(judge.ENV_URL, fake_judge.url)
    monkeypatch.setenv(judge.ENV_MODEL, "m")
    out = tmp_path / "out"
    args = ["eval", "hallucination", str(model_dir), "--out", str(out), "--quiet"]
    tiny = ["--data", str(longbench / "xsum.jsonl"), "--samples", "2", "--max-new-tokens", "4"]
    assert main([*args, *tiny, "--max-input-tokens", "100"]) == 0
    record = json.loads((out / "results.json").read_text())
    assert record["experiment"] == "hallucination"
    assert record["settings"]["judge"] == {
        "kind": "api",
        "url": fake_judge.url + "/chat/completions",
        "model": "m",
    }
    assert (out / "hallucination.png").is_file() and "Table 4" in (out / "report.md").read_text()
    capsys.readouterr()
    bad = main([*args, "--overwrite", *tiny, "--max-input-tokens", "1000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert bad == 2 and len(err) == 1 and "context of 256 tokens" in err[0]
    monkeypatch.delenv(judge.ENV_MODEL)
    bad = main([*args, "--overwrite", *tiny])
    err = capsys.readouterr().err.strip().splitlines()
    assert bad == 2 and len(err) == 1 and "DIFFATTN_JUDGE_MODEL" in err[0]
