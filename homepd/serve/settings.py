"""The service's own options (the engine's are ``EngineConfig``): frozen, one default each.

Each is a ``homepd serve`` flag, a ``HOMEPD_*`` variable and a key of the
config file's ``[serve]`` table (``homepd.config.add_option_flags``).
"""
from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass, field

from homepd.config import option as _opt, parse_bool, parse_size
from homepd.core.terms import RequestClass
from homepd.errors import ConfigError
from homepd.measure.trace.model import TraceError
from homepd.measure.trace.sources import parse_duration_s

# why 8439: unassigned, and not a port a common local LLM server or UI uses
# (llama.cpp 8080, vLLM 8000, Ollama 11434, LM Studio 1234, KoboldCpp 5001, Open WebUI 3000/8080, ...)
DEFAULT_PORT = 8439
REQUEST_CLASSES = tuple(c.value for c in RequestClass)


def parse_origins(text: str) -> tuple[str, ...]:
    """Comma-separated CORS origins ('' = CORS off)."""
    return tuple(o.strip() for o in text.split(",") if o.strip())


def parse_seconds(text: str) -> float:
    """Seconds, or a duration (90s, 5m, 2h); 0 allowed (ValueError, with what is accepted, otherwise)."""
    if str(text).strip() in ("0", "0s", "0.0"):
        return 0.0
    try:
        return parse_duration_s(str(text), "a duration")
    except TraceError as exc:
        raise ValueError(str(exc)) from None


def parse_keep_alive(text: str) -> float | None:
    """A keep-alive: a duration (90s, 5m) or seconds; negative means for good (None)."""
    text = str(text).strip()
    if text.startswith("-"):
        return None
    return parse_seconds(text)


def parse_durations(text: str) -> tuple[float, ...]:
    """Comma-separated durations (5m,1h,24h)."""
    return tuple(parse_seconds(part) for part in str(text).split(",") if part.strip())


class _AddNames(argparse.Action):
    """A repeatable flag of comma-separated names: the first use replaces the default (the environment's or
    the config file's), later ones add to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = getattr(namespace, f"_{self.dest}_given", False)
        before = tuple(getattr(namespace, self.dest) or ()) if seen else ()
        setattr(namespace, self.dest, tuple(dict.fromkeys((*before, *values))))
        setattr(namespace, f"_{self.dest}_given", True)


@dataclass(frozen=True)
class ServeSettings:
    host: str = field(default="127.0.0.1", metadata=_opt(
        "host", help="address to listen on (a non-loopback one needs --api-key)"))
    port: int = field(default=DEFAULT_PORT, metadata=_opt("port", int, "TCP port"))
    api_key: str | None = field(default=None, metadata=_opt(
        "api-key", help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(prefer HOMEPD_API_KEY: a flag shows in ps)"))
    drain_timeout_s: float = field(default=30.0, metadata=_opt(
        "drain-timeout", float, "on SIGTERM: seconds running requests may take to finish before they are aborted"))
    max_queue: int = field(default=16, metadata=_opt(
        "max-queue", int, "requests that may wait for a free sequence; more are refused with 503 + Retry-After"))
    max_prompt_bytes: int = field(default=1 << 20, metadata=_opt(
        "max-prompt-bytes", int, "largest prompt (or all messages' text) in UTF-8 bytes; larger is 413"))
    max_tokens: int = field(default=2048, metadata=_opt(
        "max-tokens", int, "most tokens a request may ask to generate, and what it gets when it does not say"))
    cors_origins: tuple[str, ...] = field(default=(), metadata=_opt(
        "cors-origins", parse_origins, "comma-separated origins allowed by CORS (default: CORS off)"))
    chat_class: str = field(default="interactive", metadata=_opt(
        "chat-class", help="request class of /v1/chat/completions when a request names none", choices=REQUEST_CLASSES))
    completions_class: str = field(default="interactive", metadata=_opt(
        "completions-class", help="request class of /v1/completions when a request names none",
        choices=REQUEST_CLASSES))
    allowed_hosts: tuple[str, ...] = field(default=(), metadata=_opt(
        "allowed-hosts", parse_origins, "comma-separated Host names the service answers to besides loopback "
                                        "ones; without an API key only these and loopback names are answered "
                                        "(a guard against DNS rebinding)"))
    strict_fields: bool = field(default=False, metadata=_opt(
        "strict-fields", parse_bool, "refuse a request with a field homepd does not know (400 unsupported_field) "
                                     "instead of ignoring it and listing it in the response's homepd.ignored_fields",
        action=argparse.BooleanOptionalAction))
    strict_model_name: bool = field(default=False, metadata=_opt(
        "strict-model-name", parse_bool, "answer 404 to a request whose model is not one of /v1/models' ids "
                                         "(default: this one-model service serves any name, as llama-server does)",
        action=argparse.BooleanOptionalAction))
    served_model_names: tuple[str, ...] = field(default=(), metadata=_opt(
        "served-model-name", parse_origins, "another id for the model in /v1/models (repeatable, or "
                                            "comma-separated: gpt-4o-mini,llama3 for clients that insist on a name)",
        action=_AddNames))
    max_messages: int = field(default=2048, metadata=_opt(
        "max-messages", int, "most messages in one chat request; more is 413"))
    header_timeout_s: float = field(default=10.0, metadata=_opt(
        "header-timeout", float, "seconds a connection may take to send a request's headers (from opening, "
                                 "or from its last response); then it is closed"))
    body_timeout_s: float = field(default=30.0, metadata=_opt(
        "body-timeout", float, "seconds a request may take to send its body once its headers are in; then it is "
                               "answered 408 and its connection closed"))
    max_connections: int = field(default=1000, metadata=_opt(
        "max-connections", int, "connections open at once (kept 128 below the file-descriptor limit, which is "
                                "re-read while serving); at the cap the connection that has been sending its "
                                "request the longest is closed to make room, and a new one is refused only when "
                                "every open connection is being served"))
    record_traffic: bool = field(default=True, metadata=_opt(
        "record-traffic", parse_bool, "record the shape of the traffic served (arrival, token counts, class, "
                                      "finish reason, prefix seen before; no text) in the store, for "
                                      "`homepd advise --traffic service`", action=argparse.BooleanOptionalAction))
    record_text: bool = field(default=False, metadata=_opt(
        "record-text", parse_bool, "also record each prompt's text (off: only its shape is kept)",
        action=argparse.BooleanOptionalAction))
    traffic_retention_days: float = field(default=30.0, metadata=_opt(
        "traffic-retention-days", float, "recorded traffic older than this many days is deleted"))
    traffic_retention_rows: int = field(default=100_000, metadata=_opt(
        "traffic-retention-rows", int, "at most this many recorded requests are kept (the newest)"))
    db: str | None = field(default=None, metadata=_opt(
        "db", help="the store the traffic is recorded in (default: $HOMEPD_DB, else the XDG data dir)"))
    step_log: str | None = field(default=None, metadata=_opt(
        "step-log", help="append every engine step to this file as a JSON line (its tokens, KV cells, prompt "
                         "budget, grant, store time and duration): what a gap or a slow first token came from "
                         "(default: none)", metavar="FILE"))
    warmup: bool = field(default=True, metadata=_opt(
        "warmup", parse_bool, "run one short request before reporting ready",
        action=argparse.BooleanOptionalAction))
    # live advice (homepd.serve.advice): the traffic profile against the stored capacity curves
    advice: bool = field(default=True, metadata=_opt(
        "advice", parse_bool, "watch the traffic and say, with the stored advise evidence, when another "
                              "configuration would serve it better (GET /advice)", action=argparse.BooleanOptionalAction))
    advice_windows_s: tuple[float, ...] = field(default=(300.0, 3600.0, 86_400.0), metadata=_opt(
        "advice-windows", parse_durations, "comma-separated windows of the live traffic profile (the first one "
                                          "is what the advice is judged on), e.g. 5m,1h,24h"))
    advice_hysteresis_s: float = field(default=120.0, metadata=_opt(
        "advice-hysteresis", parse_seconds, "how long a new verdict must hold before it is raised as advice"))
    advice_period_s: float = field(default=5.0, metadata=_opt(
        "advice-period", parse_seconds, "how often the advice is evaluated"))
    advice_min_requests: int = field(default=10, metadata=_opt(
        "advice-min-requests", int, "fewest requests in the window for the advice to judge it"))
    # embeddings (homepd.serve.embeddings, homepd.engine.embedder): a second model beside the chat model
    embedding_model: str | None = field(default=None, metadata=_opt(
        "embedding-model", help="an embedding model served beside the chat model, loaded on first use: a "
                                "catalog name (all-minilm-l6-v2) or a GGUF path (default: none; /v1/embeddings "
                                "and /api/embed then answer 400)"))
    embedding_keep_alive_s: float | None = field(default=300.0, metadata=_opt(
        "embedding-keep-alive", parse_keep_alive,
        "how long the embedding model stays loaded after a request that does not say (5m; -1: for good; 0: at once)"))
    max_embedding_inputs: int = field(default=256, metadata=_opt(
        "max-embedding-inputs", int, "most inputs in one embedding request; more is 413"))
    # several models (homepd.config.models, homepd.serve.registry): loaded on demand under one memory budget
    memory_budget_bytes: int | None = field(default=None, metadata=_opt(
        "memory-budget", parse_size, "bytes the served models may take together, e.g. 6G; a load that does not "
                                     "fit evicts idle models first (default: the RAM available at start, less a "
                                     "tenth of the RAM, at least 512M, for the OS)"))
    keep_alive_s: float | None = field(default=None, metadata=_opt(
        "keep-alive", parse_keep_alive, "with several models: how long a model stays loaded after its last request "
                                        "when its table does not say (5m; -1, the default: until its memory is "
                                        "needed); a request's keep_alive may shorten it"))
    load_timeout_s: float = field(default=300.0, metadata=_opt(
        "load-timeout", parse_seconds, "how long a request waits for its model's load, including the wait for "
                                       "busy models to make room; then 503"))
    auto_apply_interval_s: float | None = field(default=None, metadata=_opt(
        "auto-apply", parse_seconds, "switch to advised configurations by itself, at most once per this "
                                     "interval (e.g. 1h; default: never, POST /advice/apply decides)"))

    def validated(self) -> "ServeSettings":
        """Return self if consistent, else raise ConfigError naming the option."""
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be 1..65535, got {self.port}")
        for name in ("max_prompt_bytes", "max_tokens", "max_messages", "max_connections", "max_embedding_inputs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.traffic_retention_rows < 1 or not self.traffic_retention_days > 0:
            raise ConfigError("traffic_retention_rows must be >= 1 and traffic_retention_days > 0, got "
                              f"{self.traffic_retention_rows} and {self.traffic_retention_days}")
        if not self.advice_windows_s or not all(w > 0 for w in self.advice_windows_s):
            raise ConfigError(f"advice_windows_s needs at least one window > 0 s, got {self.advice_windows_s}")
        if not self.advice_period_s > 0 or self.advice_hysteresis_s < 0 or self.advice_min_requests < 1:
            raise ConfigError("advice_period_s must be > 0, advice_hysteresis_s >= 0 and advice_min_requests >= 1, "
                              f"got {self.advice_period_s}, {self.advice_hysteresis_s}, {self.advice_min_requests}")
        if not self.load_timeout_s > 0:
            raise ConfigError(f"load_timeout_s must be > 0, got {self.load_timeout_s}")
        if self.auto_apply_interval_s is not None and not self.auto_apply_interval_s > 0:
            raise ConfigError(f"--auto-apply needs a minimum interval > 0 (e.g. 1h), got {self.auto_apply_interval_s}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_queue < 0 or self.drain_timeout_s < 0:
            raise ConfigError("max_queue and drain_timeout_s must be >= 0")
        for name in ("chat_class", "completions_class"):
            if getattr(self, name) not in REQUEST_CLASSES:
                raise ConfigError(f"{name} must be one of {', '.join(REQUEST_CLASSES)}, got {getattr(self, name)!r}")
        if self.step_log is not None and (not self.step_log or os.path.isdir(self.step_log)
                                          or not os.path.isdir(os.path.dirname(os.path.abspath(self.step_log)))):
            raise ConfigError(f"--step-log needs a file in an existing directory, got {self.step_log!r}")
        if self.api_key is not None and (self.api_key != self.api_key.strip() or not self.api_key.isprintable()):
            raise ConfigError("the API key has leading or trailing spaces or control characters, which no "
                              "'Authorization: Bearer' header can carry; set it without them")
        if self.api_key is not None and len(self.api_key) < 8:
            raise ConfigError("the API key must be at least 8 characters")
        if not is_loopback(self.host) and not self.api_key:
            raise ConfigError(
                f"refusing to listen on {self.host!r} without an API key: anyone who can reach it could use it.  "
                "Set one with HOMEPD_API_KEY=... (or --api-key), e.g. HOMEPD_API_KEY=$(openssl rand -hex 24), "
                "or listen on 127.0.0.1")
        return self


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'; False for anything else (0.0.0.0, a name, a LAN address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
