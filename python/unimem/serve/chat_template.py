"""``--chat-template FILE|NAME``: the Jinja chat template ``/v1/chat/completions`` renders
messages with, when the tokenizer's own is missing (a base model) or should be replaced.

A value naming an existing file is read as a Jinja template; otherwise it must be one of
:data:`KNOWN_TEMPLATES` (the formats of model families, written for unimem). The template is
rendered by the tokenizer's ``apply_chat_template`` (``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token`` are in scope), exactly as a template shipped with the tokenizer.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ChatTemplateError", "KNOWN_TEMPLATES", "resolve_chat_template"]

_CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma has no system role: a system message is put before the first user turn's text.
_GEMMA = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] in ('system', 'developer') %}"
    "{% set ns.system = ns.system + m['content'] + '\\n\\n' %}"
    "{% else %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\\n' + ns.system + m['content'] + '<end_of_turn>\\n' }}"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

_LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content']"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

KNOWN_TEMPLATES: dict[str, str] = {"chatml": _CHATML, "gemma": _GEMMA, "llama-3": _LLAMA3}
"""Template names ``--chat-template`` accepts, and their Jinja text."""


class ChatTemplateError(ValueError):
    """``--chat-template`` names neither a readable file nor a known template."""


def resolve_chat_template(value: str) -> str:
    """The Jinja text ``value`` stands for: the contents of the file it names, or the known
    template of that name. :class:`ChatTemplateError` (one line) otherwise."""
    path = Path(value)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"--chat-template {value}: cannot read it: {e}") from None
        if not text.strip():
            raise ChatTemplateError(f"--chat-template {value}: the file is empty")
        return text
    if value in KNOWN_TEMPLATES:
        return KNOWN_TEMPLATES[value]
    known = ", ".join(sorted(KNOWN_TEMPLATES))
    raise ChatTemplateError(
        f"--chat-template {value}: no such file and not a known template name ({known})"
    )
