"""The small tree of errors homepd raises at its edges.

Every message says what is wrong and, where it helps, what to do about it.
Missing hardware is never an error (it is ``None``/NA); these are for things a
user or a caller got wrong, or a part that failed.
"""


class HomepdError(Exception):
    """Base of every error homepd raises on purpose."""


class ConfigError(HomepdError):
    """A bad option, flag or environment variable."""


class ModelError(HomepdError):
    """A model that cannot be found, fetched, verified or loaded."""


class RequestError(HomepdError):
    """A request refused before it reaches a worker (too long, bad sampling)."""


class PromptTooLongError(RequestError):
    """A prompt that does not fit the context (never truncated silently)."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int, streams: bool = False):
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx
        where = (f"a request's stream holds {n_ctx} (n_ctx / sequence ids, --kv-layout streams)" if streams
                 else f"the context holds {n_ctx} (n_ctx)")
        fix = "raise n_ctx, lower n_seq_max or use --kv-layout unified" if streams else "raise n_ctx"
        super().__init__(f"prompt is {n_prompt_tokens} tokens; {where} including at least one generated token — "
                         f"shorten it or {fix}")


class WorkerError(HomepdError):
    """A worker process failed or died while holding requests."""


class EngineError(HomepdError):
    """The engine is not in a state to do what was asked."""


class ExtentError(HomepdError):
    """A shared-memory KV extent (of the arena or the KV store) that is corrupted or does not match."""
