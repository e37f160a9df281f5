"""The judge of ``diffattn eval hallucination``: a binary verdict per model output, after the
protocol DIFF V1 §3.6 (Table 4) takes from Lookback Lens (Chuang et al. 2024), where GPT-4o
judges whether an output is accurate and free of hallucinations given the ground truth.

Prompt: :data:`JUDGE_SYSTEM` as the system message and :data:`JUDGE_TEMPLATE` as the user
message, with the source document (cut to ``document_chars`` characters, head and tail kept),
the question (QA only), the reference answers or summaries, and the model output.

Reply parsing (:func:`parse_verdict`): the first standalone ``YES`` or ``NO`` in the reply,
case-insensitive: ``YES`` = accurate and free of hallucinations, ``NO`` = hallucinated. A reply
with neither is *unparsed*: recorded, left out of the accuracy and counted in the report.

Judges:

* :class:`HTTPJudge`: any OpenAI-compatible chat-completions endpoint. ``DIFFATTN_JUDGE_URL``
  (the base URL, e.g. ``https://api.openai.com/v1``, or the full ``…/chat/completions``),
  ``DIFFATTN_JUDGE_MODEL`` (e.g. ``gpt-4o``) and ``DIFFATTN_JUDGE_API_KEY`` (optional; sent as
  a bearer token) come from the environment. Requests use temperature 0 and at most 8 reply
  tokens, a timeout per request, and a bounded number of attempts with exponential backoff on
  connection errors, timeouts, HTTP 429 and 5xx; other HTTP errors fail at once.
* :class:`LocalJudge`: a local model (diffattn or Hugging Face directory): the verdict is the
  more likely of ``" YES"`` and ``" NO"`` after the prompt and ``"\\nVerdict:"`` (full
  log-probabilities through :mod:`diffattn.eval.label_trie`), so it always parses.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

JUDGE_SYSTEM = (
    "You are a careful fact checker. You decide whether a model's output is accurate and "
    "faithful to a source document."
)
JUDGE_TEMPLATE = """Source document:
{document}

{question}Reference {reference_kind}:
{references}

Model output:
{output}

Is the model output accurate and free of hallucinations, that is, is everything it states \
supported by the source document and consistent with the reference? Reply with one word: YES \
if it is accurate and free of hallucinations, NO if it contains any hallucinated, unsupported \
or incorrect content."""
ENV_URL, ENV_MODEL, ENV_KEY = "DIFFATTN_JUDGE_URL", "DIFFATTN_JUDGE_MODEL", "DIFFATTN_JUDGE_API_KEY"
RETRY_STATUS = (429, 500, 502, 503, 504)
_VERDICT = re.compile(r"\b(YES|NO)\b", re.IGNORECASE)


def cut_middle(text: str, limit: int) -> str:
    """``text`` with its middle replaced by `` … `` so that it has at most ``limit``
    characters (head and tail kept); ``limit`` 0 means no cut."""
    if limit <= 0 or len(text) <= limit:
        return text
    half = max((limit - 5) // 2, 0)
    return text[:half] + " […] " + text[len(text) - half :]


def judge_prompt(
    document: str,
    question: str,
    references: list[str],
    output: str,
    task: str,
    document_chars: int = 8000,
) -> str:
    """The user message of the judge (see the module docstring)."""
    return JUDGE_TEMPLATE.format(
        document=cut_middle(document, document_chars),
        question=f"Question:\n{question}\n\n" if task == "qa" and question else "",
        reference_kind="answer(s)" if task == "qa" else "summary",
        references="\n".join(f"- {r}" for r in references) or "(none)",
        output=output or "(empty)",
    )


def parse_verdict(reply: str) -> bool | None:
    """``True`` (free of hallucination), ``False`` (hallucinated) or ``None`` (unparsed)."""
    found = _VERDICT.search(reply or "")
    if found is None:
        return None
    return found.group(1).upper() == "YES"


@dataclass
class HTTPJudge:
    """An OpenAI-compatible chat-completions endpoint (see the module docstring)."""

    url: str
    model: str
    api_key: str | None = None
    timeout: float = 60.0
    attempts: int = 3
    backoff: float = 1.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"judge URL must start with http:// or https://, got {self.url!r}")
        if self.attempts < 1 or self.timeout <= 0:
            raise ValueError("--judge-attempts must be at least 1 and --judge-timeout positive")
        if not self.url.rstrip("/").endswith("/chat/completions"):
            self.url = self.url.rstrip("/") + "/chat/completions"

    @classmethod
    def from_env(cls, **options: Any) -> HTTPJudge:
        url, model = os.environ.get(ENV_URL), os.environ.get(ENV_MODEL)
        if not url or not model:
            raise ValueError(
                f"--judge api needs {ENV_URL} and {ENV_MODEL} in the environment "
                f"({ENV_KEY} too when the endpoint wants a key)"
            )
        return cls(url, model, os.environ.get(ENV_KEY) or None, **options)

    def describe(self) -> dict[str, Any]:
        return {"kind": "api", "url": self.url, "model": self.model}

    def reply(self, prompt: str) -> str:
        body = json.dumps(
            {
                "model": self.model,
                "messages": [
                    {"role": "system", "content": JUDGE_SYSTEM},
                    {"role": "user", "content": prompt},
                ],
                "temperature": 0,
                "max_tokens": 8,
            }
        ).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        problem = ""
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), 30.0))
            request = urllib.request.Request(self.url, body, headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    answer = json.loads(response.read().decode("utf-8"))
                return str(answer["choices"][0]["message"]["content"] or "")
            except urllib.error.HTTPError as error:
                problem = f"HTTP {error.code}"
                if error.code not in RETRY_STATUS:
                    raise ValueError(f"judge {self.url}: {problem} {error.reason}") from None
            except (urllib.error.URLError, TimeoutError, OSError) as error:
                problem = str(getattr(error, "reason", error))
            except (ValueError, KeyError, IndexError, TypeError):
                raise ValueError(f"judge {self.url}: not a chat-completions reply") from None
        raise ValueError(f"judge {self.url}: no answer after {self.attempts} attempts ({problem})")


class LocalJudge:
    """A local model as judge: the more likely of " YES" and " NO" (see the module docstring)."""

    SUFFIX = "\nVerdict:"

    def __init__(self, model: Any) -> None:
        from diffattn.eval.common import require_tokenizer
        from diffattn.eval.label_trie import LabelTrie

        self.model = model
        self.tokenizer = require_tokenizer(model)
        self.trie = LabelTrie({word: self.tokenizer.encode(f" {word}") for word in ("YES", "NO")})

    def describe(self) -> dict[str, Any]:
        return {"kind": "local", "model": self.model.spec}

    def reply(self, prompt: str) -> str:
        from diffattn.eval.label_trie import SharedPrefix, label_logprobs
        from diffattn.eval.text import context_limit

        ids = self.tokenizer.encode(f"{JUDGE_SYSTEM}\n\n{prompt}{self.SUFFIX}", special=True)
        limit = (context_limit(self.model) or len(ids) + self.trie.depth) - self.trie.depth
        if len(ids) > limit:  # keep the end: the output and the question come last
            ids = ids[len(ids) - limit :]
        scores = label_logprobs(SharedPrefix(self.model.model, ids[:-1]), ids[-1:], self.trie)
        return max(scores, key=lambda word: scores[word])
