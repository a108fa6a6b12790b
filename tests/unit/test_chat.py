from __future__ import annotations

import pytest

from homepd.engine.prompt import CHATML_TEMPLATE, render_chat, validate_messages
from homepd.errors import RequestError


def test_chatml_fallback_renders_roles_and_generation_prompt():
    text = render_chat(None, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_model_template_gets_bos_and_eos():
    tmpl = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
    assert render_chat(tmpl, [{"role": "user", "content": "x"}], "<s>", "</s>") == "<s>[user]x</s>"


@pytest.mark.parametrize("evil", ["{{ messages.__class__.__mro__[1].__subclasses__() }}",
                                  "{{ messages.append(1) }}"])
def test_template_runs_in_an_immutable_sandbox(evil):
    with pytest.raises(RequestError, match="is unsafe"):
        render_chat(evil, [{"role": "user", "content": "x"}])


def test_template_raise_exception_becomes_request_error():
    tmpl = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(RequestError, match="roles must alternate"):
        render_chat(tmpl, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty list"), ("hi", "non-empty list"), ([{"role": "user"}], r"messages\[0\].content"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\].role"), (["x"], r"messages\[0\] must be an object"),
])
def test_bad_messages_are_named(messages, match):
    with pytest.raises(RequestError, match=match):
        validate_messages(messages)


def test_chatml_constant_is_valid_jinja():
    assert "<|im_start|>" in render_chat(CHATML_TEMPLATE, [{"role": "user", "content": "x"}])
