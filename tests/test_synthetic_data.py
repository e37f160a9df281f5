"""The synthetic retrieval sources ``synthetic:recall`` and ``synthetic:needle``."""

from __future__ import annotations

import re

import pytest

from diffattn.data import iter_documents
from diffattn.data.sources import check_sources_exist, fingerprint_sources
from diffattn.data.synthetic import CITIES, RECALL_KEYS, parse_synthetic_spec
from diffattn.eval import needle


def test_recall_documents_are_answerable_only_from_context():
    docs = list(iter_documents("synthetic:recall?docs=50&pairs=6&queries=4&seed=3"))
    assert len(docs) == 50
    assert len(set(docs)) == 50
    for doc in docs:
        listed, recalled = re.fullmatch(r"Pairs: (.*)\. Recall: (.*)\.", doc).groups()
        pairs = dict(item.split(" ") for item in listed.split(", "))
        asked = [item.split(" ") for item in recalled.split(", ")]
        assert len(pairs) == 6 and len(asked) == 4
        assert all(k in RECALL_KEYS for k in pairs)
        assert all(pairs[k] == v for k, v in asked)  # every recalled value is the listed one
        assert len({k for k, _ in asked}) == 4


def test_needle_documents_answer_their_question_in_eval_format():
    docs = list(iter_documents("synthetic:needle?docs=40&needles=5&queries=2&words=60"))
    for doc in docs:
        found = re.findall(r"The magic number of ([A-Za-z ]+?) is (\d{7})\.", doc.split("\n\n")[0])
        cities = [c for c, _ in found]
        assert 1 <= len(found) <= 5 and len(set(cities)) == len(cities)
        assert all(c in CITIES for c in cities)
        assert len({n for _, n in found}) == len(found)
        numbers = dict(found)
        tail = doc.split("\n\n", 1)[1]
        if tail.startswith("Question: What is"):
            city = re.match(r"Question: What is the magic number of (.+?)\?", tail).group(1)
            assert tail.endswith(f"The magic number of {city} is {numbers[city]}.")
        else:
            asked = re.match(r"Question: What are the magic numbers of (.+?)\?", tail).group(1)
            names = re.split(r", | and ", asked)
            assert tail.endswith(
                " " + ", ".join(numbers[c] for c in names[:-1]) + f" and {numbers[names[-1]]}."
            )
        # the question uses the evaluation's exact templates
        assert needle.QUESTION_ONE.split("{")[0] in doc or needle.QUESTION_MANY.split("{")[0] in doc


def test_documents_depend_only_on_the_spec():
    spec = "synthetic:needle?docs=5&seed=7"
    assert list(iter_documents(spec)) == list(iter_documents(spec))
    assert list(iter_documents(spec)) != list(iter_documents("synthetic:needle?docs=5&seed=8"))
    assert fingerprint_sources([spec]) == fingerprint_sources([spec])
    assert fingerprint_sources([spec]) != fingerprint_sources(["synthetic:needle?docs=6&seed=7"])
    check_sources_exist([spec, "synthetic:recall"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("synthetic:copy", "task must be one of"),
        ("synthetic:recall?pairs=0", "pairs must be"),
        ("synthetic:recall?pairs=4&queries=5", "queries must be in 1..pairs"),
        ("synthetic:recall?needles=2", "unknown parameter 'needles'"),
        ("synthetic:needle?needles=x", "needles must be an integer"),
        ("synthetic:needle?needles=99", "needles must be in"),
        ("synthetic:needle?docs=0", "docs must be >= 1"),
    ],
)
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_synthetic_spec(spec)
    with pytest.raises(ValueError, match=re.escape(message)):
        list(iter_documents(spec))


def test_needle_digits_set_the_length_of_every_number():
    for digits in (1, 2, 5):
        for doc in iter_documents(f"synthetic:needle?docs=20&digits={digits}&needles=4"):
            numbers = re.findall(r"is (\d+)\.", doc.split("\n\n")[0])
            assert numbers and all(len(n) == digits for n in numbers)
    with pytest.raises(ValueError, match=r"digits must be in 1\.\.12"):
        parse_synthetic_spec("synthetic:needle?digits=0")
    samples = needle.make_samples(4, 2, [100], [0], 3, seed=0, digits=2)
    assert all(len(n) == 2 for cell in samples.values() for s in cell for n in s.numbers)
