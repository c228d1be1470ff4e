"""Start-up options users reach for: ``--chat-template FILE|NAME``, the drain and
``/health_generate`` timeouts, and the README's CPU serve command parsing as written. (The
DSPARK untrained-drafter warning is the engine's: test/models/test_engine_models.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from unimem.serve.args import CliError, parse_args

BASE = ["--model-path", "/m", "--device", "cpu"]
README = Path(__file__).resolve().parents[2] / "README.md"


def test_chat_template_by_name_and_by_file(tmp_path):
    from unimem.serve.chat_template import KNOWN_TEMPLATES

    _, opts = parse_args([*BASE, "--chat-template", "gemma"])
    assert opts.chat_template == KNOWN_TEMPLATES["gemma"]
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    _, opts = parse_args([*BASE, f"--chat-template={jinja}"])
    assert opts.chat_template == jinja.read_text()
    _, opts = parse_args(BASE)
    assert opts.chat_template is None


@pytest.mark.parametrize(
    "value, message",
    [("no-such-template", "not a known template name"), ("", "not a known template name")],
)
def test_bad_chat_template_is_one_line(value, message):
    with pytest.raises(CliError) as e:
        parse_args([*BASE, "--chat-template", value])
    assert message in str(e.value) and "chatml" in str(e.value)


def test_known_templates_render_a_conversation(tmp_path):
    """Each known template renders system / user / assistant turns and the generation
    prompt through a real tokenizer's ``apply_chat_template``."""
    import tiny_tokenizer

    from unimem.serve.chat_template import KNOWN_TEMPLATES

    tok = tiny_tokenizer.save(tmp_path, 64)
    messages = [
        {"role": "system", "content": "w5"},
        {"role": "user", "content": "w6"},
        {"role": "assistant", "content": "w7"},
        {"role": "user", "content": "w8"},
    ]
    for name, template in KNOWN_TEMPLATES.items():
        text = tok.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        positions = [text.index(w) for w in ("w5", "w6", "w7", "w8")]
        assert positions == sorted(positions), name
        assert text.rstrip().endswith(("assistant", "model", "<|end_header_id|>")), (name, text)


def test_shutdown_and_health_timeouts_are_flags():
    _, opts = parse_args(
        [*BASE, "--graceful-shutdown-timeout", "2.5", "--health-generate-timeout", "7"]
    )
    assert opts.graceful_shutdown_timeout == 2.5 and opts.health_generate_timeout == 7
    for flag in ("--graceful-shutdown-timeout", "--health-generate-timeout"):
        for bad in ("0", "-1", "nan", "inf"):
            with pytest.raises(CliError, match=f"{flag} must be a positive number"):
                parse_args([*BASE, flag, bad])


def _readme_commands() -> list[tuple[str, str]]:
    """``(comment, command)`` for each launch command of the README's serve section."""
    text = README.read_text()
    section = text[text.index("## Serve a model") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    out, comment, current = [], "", ""
    for line in block.splitlines():
        if line.startswith("#"):
            comment = line
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            if current.startswith("python3 -m unimem.launch_server"):
                out.append((comment, current.strip()))
            current = ""
    return out


def test_readme_cpu_serve_command_parses_on_a_cpu_machine(monkeypatch):
    from unimem.serve import args

    monkeypatch.setattr(args, "_default_device", lambda: "cpu")  # as on a machine without CUDA
    cpu = [cmd for comment, cmd in _readme_commands() if "CPU" in comment]
    assert cpu, "the README shows no CPU serve command"
    for cmd in cpu:
        engine_args, _ = parse_args(shlex.split(cmd)[3:])
        assert engine_args.device == "cpu"
