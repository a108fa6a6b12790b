"""Render a GGUF chat template (Jinja2) in a sandbox.

The template comes from the model file, so it is untrusted: it runs in
Jinja2's immutable sandbox, and any template error becomes a RequestError.
"""
from __future__ import annotations

from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from homepd.errors import RequestError

ROLES = ("system", "user", "assistant", "tool")

# why: used when a GGUF carries no template; ChatML is what SmolLM2 and many small models use.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def validate_messages(messages: object) -> list[dict[str, str]]:
    """Check an OpenAI-style message list; return it normalised, or raise RequestError."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader())
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def render_chat(template: str | None, messages: list[dict[str, str]], bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True) -> str:
    """Render messages with the model's template (ChatML when the model has none)."""
    messages = validate_messages(messages)
    try:
        return _compile(template or CHATML_TEMPLATE).render(
            messages=messages, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise RequestError(f"the model's chat template refused these messages: {exc}") from exc
