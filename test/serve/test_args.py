"""The launcher's command line: SGLang's spellings map onto EngineArgs; every error is one
line and exit status 2, an unsupported SGLang flag is refused by name."""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import fields

import pytest

from unimem.engine.args import EngineArgs
from unimem.serve.args import CliError, build_parser, parse_args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sglang_flags_map_onto_engine_args():
    engine, server = parse_args(
        [
            "--model-path",
            "/m",
            "--device",
            "cpu",
            "--dtype",
            "half",
            "--page-size",
            "32",
            "--enable-unified-memory",
            "--max-total-tokens",
            "4096",
            "--max-running-requests",
            "8",
            "--chunked-prefill-size",
            "256",
            "--speculative-algorithm",
            "dspark",
            "--speculative-num-draft-tokens",
            "4",
            "--attention-backend",
            "torch",
            "--context-length",
            "1024",
            "--random-seed",
            "3",
            "--host",
            "0.0.0.0",
            "--port",
            "8080",
            "--served-model-name",
            "m",
            "--api-key",
            "k",
            "--log-level",
            "warning",
            "--enable-metrics",
        ]
    )
    assert engine.model_path == "/m" and engine.dtype == "float16" and engine.page_size == 32
    assert engine.enable_unified_memory and engine.max_total_tokens == 4096
    assert engine.max_running_requests == 8 and engine.chunked_prefill_size == 256
    assert engine.speculative_algorithm == "DSPARK" and engine.gamma == 3
    assert engine.attention_backend == "torch" and engine.context_length == 1024
    assert engine.random_seed == 3
    assert (server.host, server.port, server.served_model_name) == ("0.0.0.0", 8080, "m")
    assert server.api_key == "k" and server.log_level == "warning"


def test_server_warmup_flag():
    _, server = parse_args(["--model-path", "/m", "--device", "cpu"])
    assert not server.skip_server_warmup  # warmed up by default, as SGLang's server
    _, server = parse_args(["--model-path", "/m", "--device", "cpu", "--skip-server-warmup"])
    assert server.skip_server_warmup


def test_stream_interval_flag():
    _, server = parse_args(["--model-path", "/m", "--device", "cpu"])
    assert server.stream_interval == 1  # SGLang's default: every token
    _, server = parse_args(["--model-path", "/m", "--device", "cpu", "--stream-interval", "4"])
    assert server.stream_interval == 4


def test_cuda_graph_bs_flag():
    """SGLang's ``--cuda-graph-bs``: the batch sizes to record; the recorded buckets are those
    up to the running requests, and the running requests themselves."""
    from unimem.engine.args import graph_buckets

    engine, _ = parse_args(["--model-path", "/m", "--device", "cuda", "--cuda-graph-bs", "64",
                            "8", "512", "8"])  # fmt: skip
    assert engine.cuda_graph_bs == (8, 64, 512) and engine.graph_cap() == 512
    engine, _ = parse_args(["--model-path", "/m", "--device", "cuda"])
    assert engine.cuda_graph_bs is None and engine.graph_cap() is None
    assert graph_buckets(None, 48) is None
    assert graph_buckets((8, 64, 512), 512) == (8, 64, 512)
    assert graph_buckets((8, 64, 512), 100) == (8, 64, 100)  # max_running_requests 100
    assert graph_buckets((1,), 1) == (1,)


def test_every_engine_argument_has_its_sglang_flag():
    flags = {opt for a in build_parser()._actions for opt in a.option_strings}
    for f in fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in flags, f.name


def test_defaults_follow_sglang():
    engine, server = parse_args(["--model", "/m", "--device", "cpu"])
    assert engine.model_path == "/m" and not engine.enable_unified_memory
    assert (server.host, server.port, server.served_model_name) == ("127.0.0.1", 30000, "/m")
    assert server.api_key is None
    assert not engine.disable_radix_cache and engine.mamba_track_interval is None
    assert engine.speculative_verify_lengths == "fixed"


def test_prefix_cache_and_verify_length_flags():
    engine, _ = parse_args(
        [
            "--model-path",
            "/m",
            "--device",
            "cpu",
            "--disable-radix-cache",
            "--speculative-algorithm",
            "DSPARK",
            "--speculative-verify-lengths",
            "adaptive",
            "--speculative-verify-budget",
            "16",
        ]
    )
    assert engine.disable_radix_cache
    assert engine.speculative_verify_lengths == "adaptive"
    assert engine.speculative_verify_budget == 16
    engine, _ = parse_args(
        ["--model-path", "/m", "--device", "cpu", "--mamba-track-interval", "64"]
    )
    assert not engine.disable_radix_cache and engine.checkpoint_interval_pages == 64 // 16


def test_quantization_flag():
    engine, _ = parse_args(["--model-path", "/m", "--quantization", "fp8"])
    assert engine.quantization == "fp8"
    engine, _ = parse_args(["--model-path", "/m"])
    assert engine.quantization is None


def test_grammar_backend_flag():
    engine, _ = parse_args(["--model-path", "/m"])
    assert engine.grammar_backend == "xgrammar"  # SGLang's default
    engine, _ = parse_args(["--model-path", "/m", "--grammar-backend", "none"])
    assert engine.grammar_backend == "none"


def test_deterministic_inference_flag():
    engine, _ = parse_args(
        ["--model-path", "/m", "--device", "cuda", "--enable-deterministic-inference"]
    )
    assert engine.enable_deterministic_inference
    engine, _ = parse_args(["--model-path", "/m", "--device", "cuda"])
    assert not engine.enable_deterministic_inference


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dp-size", "0"], "--dp-size must be a positive integer"),
        (["--dp-size", "2", "--nnodes", "2"], "--dp-size with --nnodes is not supported"),
        (["--tp-size", "2", "--nnodes", "2"], "needs --dist-init-addr"),
        (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "multiple of nnodes"),
        (["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "h"], "HOST:PORT"),
        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size is an SGLang flag"),
        (["--tp-size", "0"], "--tp-size must be a positive int"),
        (["--tp=2"], "--tp is an SGLang flag"),
        (["--quantization", "awq"], "invalid choice: 'awq'"),
        (["--grammar-backend", "outlines"], "invalid choice: 'outlines'"),
        (["--trust-remote-code"], "--trust-remote-code is an SGLang flag"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--page-size", "0"], "--page-size must be a positive int"),
        (["--max-running-requests", "-1"], "--max-running-requests must be a positive int"),
        (["--mem-fraction-static", "nan", "--device", "cuda"], "--mem-fraction-static"),
        (["--attention-backend", "flashinfer"], "invalid choice: 'flashinfer'"),
        (["--speculative-algorithm", "EAGLE"], "invalid choice: 'EAGLE'"),
        (["--speculative-num-draft-tokens", "4"], "needs --speculative-algorithm DSPARK"),
        (["--cuda-graph-max-bs", "8"], "--cuda-graph-max-bs applies to device cuda only"),
        (["--cuda-graph-bs", "8", "16"], "--cuda-graph-bs applies to device cuda only"),
        (["--cuda-graph-bs", "0", "--device", "cuda"], "--cuda-graph-bs must be a positive int"),
        (
            ["--cuda-graph-bs", "64", "--cuda-graph-max-bs", "32", "--device", "cuda"],
            "--cuda-graph-bs 64 exceeds --cuda-graph-max-bs 32",
        ),
        (["--cuda-graph-bs", "--device", "cuda"], "expected at least one argument"),
        (["--port", "70000"], "--port must be in [1, 65535]"),
        (["--stream-interval", "0"], "--stream-interval must be a positive integer"),
        (["--page-size", "many"], "invalid int value"),
        (
            ["--speculative-verify-lengths", "adaptive"],
            "--speculative-verify-lengths adaptive needs --speculative-algorithm DSPARK",
        ),
        (["--speculative-verify-lengths", "short"], "invalid choice: 'short'"),
        (
            ["--speculative-algorithm", "DSPARK", "--speculative-verify-budget", "8"],
            "--speculative-verify-budget needs --speculative-verify-lengths adaptive",
        ),
        (["--mamba-track-interval", "20"], "--mamba-track-interval must be a multiple of"),
        (
            ["--enable-deterministic-inference"],
            "--enable-deterministic-inference applies to device cuda only",
        ),
        (
            ["--disable-radix-cache", "--mamba-track-interval", "32"],
            "--mamba-track-interval needs the radix cache",
        ),
    ],
)
def test_bad_command_lines_name_the_problem(argv, message):
    with pytest.raises(CliError) as e:
        parse_args(["--model-path", "/m", "--device", "cpu", *argv])
    assert message in str(e.value)


def test_cli_errors_are_one_line_and_exit_2(tmp_path):
    for argv in (["--dp-size", "0"], ["--page-size", "0"]):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "unimem.launch_server",
                "--model-path",
                str(tmp_path),
                "--device",
                "cpu",
                *argv,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("unimem.launch_server: error: ")
    # not a checkpoint: found at start-up, one line, before anything is served
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "unimem.launch_server",
            "--model-path",
            str(tmp_path),
            "--device",
            "cpu",
            "--port",
            str(_free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
