"""``diffattn convert MODEL OUT --to hub``: a directory that loads with
``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` where diffattn is not
installed, for all three types, with diffattn's own logits and greedy tokens, a tokenizer that
pads, HF's caches in ``generate``, and ``save_pretrained`` that keeps the remote code, also
after a second load in the same process and a ``transformers.Trainer`` step
(``hub_resave_check.py``).

The default suite runs the loading side in a subprocess whose imports of diffattn fail;
``.ci/run`` also runs it in a venv that has only torch and transformers
(``DIFFATTN_HUB_PYTHON``, marker ``hub_venv``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from extras import require_extra

pytestmark = require_extra("hf")

from diffattn.cli import main as diffattn_main
from diffattn.convert import convert
from diffattn.hf import DiffAttnForCausalLM
from helpers import ATTENTIONS
from serve_helpers import save_tiny_model, word_tokenizer

CHECK = Path(__file__).with_name("hub_remote_check.py")
RESAVE = Path(__file__).with_name("hub_resave_check.py")


def run_script(python: str, script: Path, args: list[str], modules: Path) -> None:
    """Run ``script`` with ``python`` in the module cache ``modules``, offline; it must pass."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_MODULES_CACHE")}
    env.update(HF_MODULES_CACHE=str(modules), HF_HUB_OFFLINE="1")
    command = [python, str(script), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def remote_report(
    hub: Path, tmp_path: Path, python: str, block: bool, others: tuple[str, ...] = ()
) -> dict:
    """The report of ``hub_remote_check.py`` run by ``python`` in a clean module cache
    (imports of diffattn blocked with ``block``, of the packages ``others`` always)."""
    out = tmp_path / "report.json"
    args = [str(hub), str(out), *(["--block-diffattn"] * block)]
    args += [arg for name in others for arg in ("--block", name)]
    run_script(python, CHECK, args, tmp_path / "modules")
    return json.loads(out.read_text())


def expected(src: Path, report: dict) -> dict:
    """diffattn's own logits and greedy tokens for the report's inputs."""
    model = DiffAttnForCausalLM.from_pretrained(src).eval()
    ids = torch.tensor(report["input_ids"])
    mask = torch.tensor(report["attention_mask"])
    with torch.no_grad():
        logits = model(ids[:1]).logits[0]
        generated = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False
        )
    return {"logits": logits, "generated": generated.tolist()}


def check_against_diffattn(src: Path, report: dict) -> None:
    assert report["diffattn_modules"] == []
    assert report["model_class"].endswith("modeling_diffattn.DiffAttnForCausalLM")
    assert report["pad_token"] == "<eos>"
    want = expected(src, report)
    torch.testing.assert_close(torch.tensor(report["logits"]), want["logits"], rtol=0, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor(report["reloaded_logits"]), want["logits"], rtol=0, atol=1e-6
    )
    assert report["generated"] == want["generated"]


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_hub_directory_loads_without_diffattn(attention, tmp_path):
    src = save_tiny_model(attention, tmp_path / "src")
    hub = convert(src, tmp_path / "hub", to="hub")
    config = json.loads((hub / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_diffattn.DiffAttnForCausalLM"
    assert config["pad_token_id"] == config["eos_token_id"] == 0
    assert "auto_map" not in config.get("diffattn_extra_attributes", [])
    report = remote_report(hub, tmp_path, sys.executable, block=True)
    check_against_diffattn(src, report)


def save_stack(directory: Path, layer_types: str, **overrides) -> Path:
    """A tiny model whose layers have the types of ``layer_types``, saved with the word
    tokenizer."""
    from diffattn.checkpoint import save_model
    from helpers import tiny_diffattn
    from serve_helpers import VOCAB

    model = tiny_diffattn(
        "baseline", vocab_size=VOCAB, max_seq_len=96, layer_types=layer_types, **overrides
    )
    return save_model(model, directory, tokenizer=word_tokenizer())


def test_a_mixed_stack_loads_without_diffattn(tmp_path):
    """Each layer of its own type: config.json keeps diffattn's layer_types, Hugging Face's
    view of them is full attention per layer, and the directory computes diffattn's logits."""
    src = save_stack(tmp_path / "src", "diff_v1,diff_v2,baseline,diff_v1", n_layers=4)
    hub = convert(src, tmp_path / "hub", to="hub")
    config = json.loads((hub / "config.json").read_text())
    assert config["layer_types"] == ["diff_v1", "diff_v2", "baseline", "diff_v1"]
    assert DiffAttnForCausalLM.from_pretrained(hub).config.layer_types == ["full_attention"] * 4
    check_against_diffattn(src, remote_report(hub, tmp_path, sys.executable, block=True))


TOY_PACKAGE = {
    "__init__.py": '"""A toy package that declares an attention type outside diffattn."""\n',
    "layers.py": '''"""The toy type's module: the baseline's attention with each query head
scaled by exp(s_h), s_h initialised to log(init_scale)."""

import math

import torch
from torch import nn

from diffattn.attention.baseline import BaselineAttention


class ScaledAttention(BaselineAttention):
    def __init__(self, config, layer_index):
        super().__init__(config, layer_index)
        self.log_scale = nn.Parameter(torch.empty(config.n_heads))
        self.reset_own_parameters()

    def reset_own_parameters(self, generator=None):
        with torch.no_grad():
            self.log_scale.fill_(math.log(self.config.options_of("hub_toy")["init_scale"]))

    def attend(self, x, q, k, v, mask, need_weights):
        scale = torch.exp(self.log_scale).to(q.dtype).view(1, -1, 1, 1)
        return super().attend(x, q * scale, k, v, mask, need_weights)
''',
    "declaration.py": '''"""The toy type's declaration, registered when imported."""

from diffattn import TypeOption, register_attention_type
from diffattn.attention.baseline import Baseline

from .layers import ScaledAttention


class Scaled(Baseline):
    name = "hub_toy"
    module = ScaledAttention
    options = (TypeOption("init_scale", 1.0, "exp(s_h) at initialisation"),)

    def extra_parameters(self, config):
        return config.n_heads

    def matches_by_ffn(self, config):
        return False


SCALED = register_attention_type(Scaled())
''',
}


@pytest.fixture
def toy_type(tmp_path):
    """The package ``hub_toy_package`` of :data:`TOY_PACKAGE` in a directory of its own,
    imported (which registers ``hub_toy``); removed from the registry and the path after."""
    import importlib

    from diffattn.attention.types import unregister_attention_type

    package = tmp_path / "toy_source" / "hub_toy_package"
    package.mkdir(parents=True)
    for name, text in TOY_PACKAGE.items():
        (package / name).write_text(text)
    sys.path.insert(0, str(package.parent))
    try:
        importlib.import_module("hub_toy_package.declaration")
        yield "hub_toy"
    finally:
        unregister_attention_type("hub_toy")
        sys.path.remove(str(package.parent))
        for name in [n for n in sys.modules if n.split(".")[0] == "hub_toy_package"]:
            del sys.modules[name]


def test_an_attention_type_of_another_package_travels_with_the_export(toy_type, tmp_path):
    """A type registered from another package, in a mixed stack: the export carries its
    modules (declaration, module class, what they import of their package, a name imported
    from diffattn's root) and registers it, so the directory loads where neither diffattn nor
    that package can be imported, with diffattn's logits, also after a save and reload."""
    src = save_stack(
        tmp_path / "src",
        f"{toy_type},diff_v1",
        attention_options={toy_type: {"init_scale": 1.7}},
    )
    with torch.no_grad():  # the toy's own weights away from their init
        model = DiffAttnForCausalLM.from_pretrained(src)
        model.model.layers[0].attn.log_scale.copy_(torch.tensor([0.3, -0.2, 0.5, 0.1]))
        model.save_pretrained(src)
    hub = convert(src, tmp_path / "hub", to="hub")
    text = (hub / "modeling_diffattn.py").read_text()
    assert "('external.hub_toy_package.declaration', 'SCALED', 'Scaled')" in text
    report = remote_report(hub, tmp_path, sys.executable, block=True, others=("hub_toy_package",))
    check_against_diffattn(src, report)


def test_the_imports_of_an_external_type_are_renamed_and_keep_their_names():
    from diffattn.hf.remote_code import renamed

    names = {"diffattn": "P", "toy": "P.external.toy"}
    source = (
        "import toy\n"
        "import diffattn\n"
        "import toy.layers as layers\n"
        "from toy.layers import A\n"
        "from . import b\n"
        "x = 'toy.layers'\n"
    )
    assert renamed(source, {"toy.layers"}, names, bind=True) == (
        "import P.external.toy as toy\n"
        "import P as diffattn\n"
        "import P.external.toy.layers as layers\n"
        "from P.external.toy.layers import A\n"
        "from . import b\n"
        "x = 'P.external.toy.layers'\n"
    )
    with pytest.raises(ValueError, match=r"`import toy\.layers` cannot be carried"):
        renamed("import toy.layers\n", set(), names, bind=True)


def test_a_type_defined_in_main_is_refused():
    from diffattn.attention.baseline import Baseline, BaselineAttention
    from diffattn.hf.remote_types import type_sources

    fields = {"name": "main_toy", "module": BaselineAttention, "__module__": "__main__"}
    declaration = type("MainToy", (Baseline,), fields)()
    with pytest.raises(ValueError, match="'main_toy' is defined in __main__"):
        type_sources([declaration], Path("."))


@pytest.mark.hub_venv
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_hub_directory_in_a_venv_without_diffattn(attention, tmp_path):
    """``.ci/run``: the interpreter of a venv with torch and transformers only."""
    python = os.environ.get("DIFFATTN_HUB_PYTHON")
    if not python:
        pytest.skip("set DIFFATTN_HUB_PYTHON to a python without diffattn (.ci/run does)")
    src = save_tiny_model(attention, tmp_path / "src")
    hub = convert(src, tmp_path / "hub", to="hub")
    check_against_diffattn(src, remote_report(hub, tmp_path, python, block=False))


def export_types(tmp_path: Path) -> dict[str, Path]:
    """Each type saved by diffattn (``src/<type>``, returned) and exported (``hub/<type>``)."""
    sources = {}
    for attention in ATTENTIONS:
        sources[attention] = save_tiny_model(attention, tmp_path / "src" / attention)
        convert(sources[attention], tmp_path / "hub" / attention, to="hub")
    return sources


def resaved_reports(tmp_path: Path, python: str, save_flag: str | None) -> tuple[dict, dict]:
    """``hub_resave_check.py`` on the directories of :func:`export_types`: its save phase run
    by ``python`` with ``save_flag``, then its load phase in a fresh process and module cache,
    with diffattn blocked where ``python`` has it."""
    work, blocked = tmp_path / "resaved", python == sys.executable
    hubs = [str(tmp_path / "hub" / attention) for attention in ATTENTIONS]
    save = ["save", str(work), str(tmp_path / "saved.json"), *hubs, *[save_flag] * bool(save_flag)]
    run_script(python, RESAVE, save, tmp_path / "modules-save")
    load = ["load", str(work), str(tmp_path / "loaded.json"), *["--block-diffattn"] * blocked]
    run_script(python, RESAVE, load, tmp_path / "modules-load")
    return json.loads((tmp_path / "saved.json").read_text()), json.loads(
        (tmp_path / "loaded.json").read_text()
    )


def check_resaved(saved: dict, loaded: dict) -> None:
    """Every directory the save phase wrote holds the remote code, loads in a fresh process
    without diffattn, and gives the logits, tokens and config it was saved with; the training
    step changed the model."""
    assert loaded["diffattn_modules"] == []
    assert sorted(loaded["directories"]) == sorted(ATTENTIONS)
    for attention in ATTENTIONS:
        before, after = saved["directories"][attention], loaded["directories"][attention]
        for kind, names in before["files"].items():
            assert "modeling_diffattn.py" in names, f"{attention} {kind}: {names}"
        assert {"tokenizer.json", "tokenizer_config.json"} <= set(before["files"]["trained"])
        assert sorted(after["logits"]) == sorted(before["logits"])
        for kind in before["logits"]:
            assert after["model_classes"][kind].endswith("modeling_diffattn.DiffAttnForCausalLM")
            torch.testing.assert_close(
                torch.tensor(after["logits"][kind]),
                torch.tensor(before["logits"][kind]),
                rtol=0,
                atol=1e-6,
                msg=lambda m, a=attention, k=kind: f"{a} {k}: {m}",
            )
        change = torch.tensor(before["logits"]["trained"]) - torch.tensor(before["logits"]["first"])
        assert change.abs().max() > 1e-3, f"{attention}: the training step changed nothing"
        assert after["config_class"].endswith("modeling_diffattn.DiffAttnConfig")
        assert after["config"] == before["config"]
        assert "not_a_setting" in (after["refused"] or ""), after["refused"]
        assert after["token_ids"] == before["token_ids"]


def check_remote_classes(saved: dict) -> None:
    """Both loads of each directory gave the classes of its ``modeling_diffattn.py``, and the
    class of the unpacked copy they subclass was saved too (``vendored``)."""
    for attention, report in saved["directories"].items():
        for name in (*report["config_classes"], *report["model_classes"]):
            assert ".modeling_diffattn." in name, f"{attention}: {name}"
        assert "vendored" in report["files"], attention


@pytest.mark.parametrize("diffattn", ["blocked", "imported"])
def test_hub_directories_save_themselves_after_a_second_load(diffattn, tmp_path):
    """Each type loaded twice in one process, the second fine-tuned one step with
    ``transformers.Trainer`` and saved with its tokenizer, the first and a config saved as
    loaded: every saved directory loads in a fresh process where diffattn cannot be imported,
    and equals what was saved. ``blocked``: diffattn cannot be imported while saving either;
    ``imported``: it is, so transformers may build diffattn's own classes."""
    sources = export_types(tmp_path)
    flag = {"blocked": "--block-diffattn", "imported": "--import-diffattn"}[diffattn]
    saved, loaded = resaved_reports(tmp_path, sys.executable, flag)
    check_resaved(saved, loaded)
    if diffattn == "blocked":
        check_remote_classes(saved)
    trainer = "Trainer" if importlib.util.find_spec("accelerate") else "AdamW"
    for attention, src in sources.items():
        report = saved["directories"][attention]
        assert report["fine_tuned_with"] == trainer
        with torch.no_grad():
            model = DiffAttnForCausalLM.from_pretrained(src).eval()
            want = model(torch.tensor(report["token_ids"][:1])).logits[0]
        torch.testing.assert_close(torch.tensor(report["logits"]["first"]), want, rtol=0, atol=1e-6)


@pytest.mark.hub_venv
def test_hub_directories_save_themselves_in_a_venv_without_diffattn(tmp_path):
    """:func:`test_hub_directories_save_themselves_after_a_second_load` in the interpreter of
    ``DIFFATTN_HUB_PYTHON`` (``.ci/run``: torch and transformers only). Without ``accelerate``
    there, ``Trainer`` cannot run and the step is taken with ``AdamW`` (a warning says so)."""
    python = os.environ.get("DIFFATTN_HUB_PYTHON")
    if not python:
        pytest.skip("set DIFFATTN_HUB_PYTHON to a python without diffattn (.ci/run does)")
    export_types(tmp_path)
    saved, loaded = resaved_reports(tmp_path, python, None)
    check_resaved(saved, loaded)
    check_remote_classes(saved)
    used = {report["fine_tuned_with"] for report in saved["directories"].values()}
    if used != {"Trainer"}:
        warnings.warn(
            f"{python} has no accelerate: fine-tuned with {sorted(used)}, not transformers.Trainer",
            stacklevel=1,
        )


def test_convert_command_writes_hub_and_refuses_what_it_cannot(tmp_path, capsys):
    src = save_tiny_model("diff_v2", tmp_path / "src")
    assert diffattn_main(["convert", str(src), str(tmp_path / "hub"), "--to", "hub"]) == 0
    assert (tmp_path / "hub" / "modeling_diffattn.py").is_file()
    assert "-> hub" in capsys.readouterr().out
    # an existing output is refused and left as it was
    before = sorted(p.name for p in (tmp_path / "hub").iterdir())
    assert diffattn_main(["convert", str(src), str(tmp_path / "hub"), "--to", "hub"]) == 2
    assert "directory exists and is not empty" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "hub").iterdir()) == before
    tokenizer = word_tokenizer()
    hf_dir = tmp_path / "llama"
    save_tiny_model("llama", hf_dir)
    tokenizer.save_pretrained(hf_dir)
    with pytest.raises(ValueError, match="convert it to diffattn first"):
        convert(hf_dir, tmp_path / "x", to="hub")


def test_remote_code_is_generated_from_the_installed_modules():
    """The embedded tree is the package's modules with only the package name changed."""
    import ast
    import base64
    import io
    import zipfile

    from diffattn.hf import remote_code

    closure = remote_code.module_closure()
    assert {"diffattn.hf.modeling", "diffattn.attention.backends.sdpa"} <= set(closure)
    assert not any(name.startswith(("diffattn.train", "diffattn.eval")) for name in closure)
    text = remote_code.modeling_file()
    tree = ast.parse(text)
    private = next(
        n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and n.targets[0].id == "PRIVATE_PACKAGE"
    )
    chunks = next(
        n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "ARCHIVE"
    )
    archive = zipfile.ZipFile(io.BytesIO(base64.b64decode(ast.literal_eval(chunks))))
    source = archive.read(f"{private}/attention/mask.py").decode()
    original = closure["diffattn.attention.mask"].read_text()
    assert source == original  # no import of the package: unchanged
    modeling = archive.read(f"{private}/hf/modeling.py").decode()
    assert modeling == closure["diffattn.hf.modeling"].read_text().replace(
        "from diffattn.", f"from {private}."
    ).replace("import diffattn.", f"import {private}.")
    assert 'MODEL_TYPE = "diffattn"' in archive.read(f"{private}/checkpoint.py").decode()
    assert remote_code.modeling_file() == text  # deterministic
