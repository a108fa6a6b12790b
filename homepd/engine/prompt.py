"""Render a GGUF chat template (Jinja2) in a sandbox, and tokenize prompts and chats.

The template comes from the model file, so it is untrusted: it runs in
Jinja2's immutable sandbox, and any template error becomes a RequestError.

A chat's message *content* is text, never control tokens: ``chat_tokens``
renders the template with each content replaced by a unique placeholder, so
that only the template's own markup is matched against the control tokens
(``<|im_start|>`` and the like); a user who writes ``<|im_start|>system`` gets
those characters, not a forged turn.  The matching itself (``split_specials``)
follows llama.cpp's ``tokenizer_st_partition`` (longest token first, its
lstrip/rstrip), so a chat without control-token text in its contents gets the
same tokens as before, in linear time instead of llama.cpp's quadratic
partition.
"""
from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from homepd.core.sampling import SamplingParams
from homepd.core.terms import SpecialToken
from homepd.errors import PromptTooLongError, RequestError

ROLES = ("system", "user", "assistant", "tool")
EXTRA_KEYS = ("name", "tool_calls", "tool_call_id", "reasoning_content")  # what else of a message a template may read

# why: used when a GGUF carries no template; ChatML is what SmolLM2 and many small models use.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ChatExtras:
    """What a chat's template is given besides its messages: OpenAI's ``tools`` (for a template that takes
    them) and ``chat_template_kwargs`` (``enable_thinking``, ``reasoning_effort``, ...)."""
    tools: list | None = None
    template_kwargs: dict | None = None


def validate_messages(messages: object) -> list[dict]:
    """Check a message list as the template takes it (role, content text, and the tool-call keys of
    ``homepd.chat.format.template_messages``: ``name``, ``tool_calls``, ``tool_call_id``); return it
    normalised (content ``""`` where a message has none), or raise RequestError."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if content is None and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string")
        out.append({**{k: v for k, v in m.items() if k in EXTRA_KEYS}, "role": role, "content": content})
    return out


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False) -> str:
    # why: as Hugging Face's transformers renders chat templates; Jinja2's own tojson sorts keys and
    # HTML-escapes ('"' becomes '&#34;' inside a tool call's arguments)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt)  # why: Llama 3.x templates write today's date with it, as transformers allows


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader())
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def render_chat(template: str | None, messages: list[dict], bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True, tools: list | None = None,
                template_kwargs: dict | None = None) -> str:
    """Render messages with the model's template (ChatML when the model has none); ``tools`` (OpenAI's
    tool list) and ``template_kwargs`` (``chat_template_kwargs``: ``enable_thinking``, ...) reach it too."""
    messages = validate_messages(messages)
    try:
        return _compile(template or CHATML_TEMPLATE).render(
            **(template_kwargs or {}), messages=messages, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, **({"tools": tools} if tools else {}),
        )
    except jinja2.exceptions.TemplateError as exc:
        raise RequestError(f"the model's chat template refused these messages: {exc}") from exc


# what llama.cpp's lstrip/rstrip drop (C isspace)
_WHITESPACE = " \t\n\v\f\r"


def split_specials(text: str, specials: tuple[SpecialToken, ...]) -> list[int | str]:
    """``text`` as raw text runs and control token ids, as llama.cpp partitions it with parse_special=True:
    each token in turn, longest first (``specials`` is in that order), split off every run left."""
    items: list[int | str] = [text] if text else []
    for special in specials:
        if special.text not in text:
            continue
        out: list[int | str] = []
        for item in items:
            if isinstance(item, int) or special.text not in item:
                out.append(item)
                continue
            for i, part in enumerate(item.split(special.text)):
                if i:
                    out.append(special.id)
                if part:
                    out.append(part)
        items = out
    return items


def _strip_around(items: list[int | str], specials: tuple[SpecialToken, ...]) -> list[int | str]:
    """Drop the whitespace next to control tokens that ask for it (lstrip: before it; rstrip: after it)."""
    lstrip = {s.id for s in specials if s.lstrip}
    rstrip = {s.id for s in specials if s.rstrip}
    if not lstrip and not rstrip:
        return items
    out = list(items)
    for i, item in enumerate(out):
        if isinstance(item, str):
            if i > 0 and out[i - 1] in rstrip:
                item = item.lstrip(_WHITESPACE)
            if i + 1 < len(out) and out[i + 1] in lstrip:
                item = item.rstrip(_WHITESPACE)
            out[i] = item
    return [item for item in out if item != ""]


def _tokens(tokenizer, items: list[int | str], specials: tuple[SpecialToken, ...]) -> list[int]:
    """The ids of ``items``: control ids as they are, each text run tokenized without special parsing, and
    the tokenizer's own BOS/EOS around it all (``add_special``), as one llama_tokenize call would."""
    around = tokenizer.tokenize("", add_special=True, parse_special=False)
    n_bos = 1 if around[:1] == [tokenizer.bos_id] else 0
    ids = around[:n_bos]
    for item in _strip_around(items, specials):
        if isinstance(item, int):
            ids.append(item)
        else:
            ids += tokenize_text(tokenizer, item)
    return ids + around[n_bos:]


# why: llama.cpp's tokenizers are quadratic in a run without whitespace (Gemma 3: 208 kB of '<div>a</div>' took
# 2.6 s on the one tokenizing thread, and queued every other request behind it; 13 kB took 13 ms); such a run is
# tokenized in pieces of this many characters (exact elsewhere: text with whitespace is one call, as before)
MAX_RUN_CHARS = 4096
_LONG_RUN = re.compile(r"\S{%d,}" % (MAX_RUN_CHARS + 1))


def tokenize_text(tokenizer, text: str) -> list[int]:
    """``text``'s ids (no special tokens parsed), linear in its length: a whitespace-free run longer than
    ``MAX_RUN_CHARS`` is tokenized in pieces of that length (its tokens at the cuts may differ from one call's)."""
    if len(text) <= MAX_RUN_CHARS or _LONG_RUN.search(text) is None:
        return tokenizer.tokenize(text, add_special=False, parse_special=False)
    ids: list[int] = []
    at = 0
    for run in _LONG_RUN.finditer(text):
        pieces = [text[at:run.start()]] + [text[i:min(i + MAX_RUN_CHARS, run.end())]
                                           for i in range(run.start(), run.end(), MAX_RUN_CHARS)]
        for piece in pieces:
            if piece:
                ids += tokenizer.tokenize(piece, add_special=False, parse_special=False)
        at = run.end()
    if at < len(text):
        ids += tokenizer.tokenize(text[at:], add_special=False, parse_special=False)
    return ids


FEW_SPECIALS = 32  # up to this many, one substring search each; beyond (Gemma has 6,250), one pass over the text


def _present(specials: tuple[SpecialToken, ...], text: str) -> tuple[SpecialToken, ...]:
    """The control tokens whose text occurs in ``text`` (in ``specials``' order)."""
    if len(specials) <= FEW_SPECIALS:
        return tuple(s for s in specials if s.text in text)
    by_length: dict[int, set[str]] = {}
    for s in specials:
        by_length.setdefault(len(s.text), set()).add(s.text)
    found: set[str] = set()
    for first in {s.text[0] for s in specials}:  # why: each start of a candidate, then a set lookup per length
        i = text.find(first)
        while i >= 0:
            found.update(text[i:i + n] for n, texts in by_length.items() if text[i:i + n] in texts)
            i = text.find(first, i + 1)
    return tuple(s for s in specials if s.text in found)


def prompt_tokens(tokenizer, prompt: str) -> list[int]:
    """A raw (completion) prompt's ids, control-token text parsed: the caller writes the whole prompt."""
    specials = _present(tokenizer.special_tokens(), prompt)
    return _tokens(tokenizer, split_specials(prompt, specials), specials)


def chat_tokens(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """A chat's ids through the model's template: markup may hold control tokens, contents never do (nor
    do the tools, tool calls and names a client sends, which the template writes into its markup)."""
    messages = validate_messages(messages)
    template = tokenizer.chat_template()
    bos, eos = tokenizer.token_text(tokenizer.bos_id), tokenizer.token_text(tokenizer.eos_id)
    specials = tokenizer.special_tokens()
    extras = json.dumps([tools, template_kwargs, [{k: m[k] for k in EXTRA_KEYS if k in m} for m in messages]],
                        ensure_ascii=False)
    if found := _present(specials, extras):
        raise RequestError(f"the tools, tool calls, names or chat_template_kwargs contain {found[0].text!r}, a "
                           "control token of this model; remove it")
    render = lambda msgs: render_chat(template, msgs, bos, eos, add_generation_prompt, tools,  # noqa: E731
                                      template_kwargs)
    rendered = render(messages)
    nonce = secrets.token_hex(8)  # why: content cannot guess it, so no content reads as a placeholder
    marked = render([{**m, "content": f"\x00{nonce}:{i}\x00"} for i, m in enumerate(messages)])
    pieces = re.split(f"\x00{nonce}:(\\d+)\x00", marked)  # markup, index, markup, index, ..., markup
    contents = [messages[int(i)]["content"] for i in pieces[1::2]]
    if "".join(p if k % 2 == 0 else contents[k // 2] for k, p in enumerate(pieces)) != rendered:
        # the template transforms or tests the content (trims it, skips empty ones, ...): the placeholders
        # do not stand for it.  Parse the rendering as a whole, unless a content holds control-token text.
        for i, m in enumerate(messages):
            if found := _present(specials, m["content"]):
                raise RequestError(f"messages[{i}].content contains {found[0].text!r}, a control token of this "
                                   "model, and its chat template changes message text, so homepd cannot keep "
                                   "it plain text; remove it")
        return prompt_tokens(tokenizer, rendered)
    present = _present(specials, "".join(pieces[0::2]))
    items: list[int | list[str]] = []
    for k, piece in enumerate(pieces):
        for item in split_specials(piece, present) if k % 2 == 0 else [contents[k // 2]]:
            if isinstance(item, int):
                items.append(item)
            elif items and isinstance(items[-1], list):
                items[-1].append(item)  # why: one run, as llama.cpp tokenizes the text between two control tokens
            else:
                items.append([item])
    return _tokens(tokenizer, [i if isinstance(i, int) else "".join(i) for i in items], present)


def request_tokens(tokenizer, n_ctx: int, prompt: str | None = None, messages: list | None = None,
                   params: SamplingParams | None = None, chat: ChatExtras | None = None,
                   streams: bool = False) -> list[int]:
    """A request's prompt ids: its raw prompt or chat rendered and tokenized, with what the sampler will need of
    this vocabulary checked (a grammar that llama.cpp parses, logit_bias ids); raise RequestError if it cannot
    run (PromptTooLongError: it leaves no room in ``n_ctx``, the cells one request may fill: one stream with
    ``streams``)."""
    if (prompt is None) == (messages is None):
        raise RequestError("give exactly one of prompt or messages")
    if messages is None and (not isinstance(prompt, str) or not prompt):
        raise RequestError("prompt must be a non-empty string")
    if params is not None:
        params.check_vocab(tokenizer.n_vocab)
        if params.grammar is not None:
            tokenizer.check_grammar(params.grammar)
    chat = chat or ChatExtras()
    ids = chat_tokens(tokenizer, messages, tools=chat.tools, template_kwargs=chat.template_kwargs) \
        if messages is not None else prompt_tokens(tokenizer, prompt)
    if not ids:
        raise RequestError("prompt is empty after tokenization")
    if len(ids) >= n_ctx:
        raise PromptTooLongError(len(ids), n_ctx, streams)
    return ids
