"""The service's bounds that need no server: settings refused at start-up, the connection limit, the rate
limit on repeated log lines, the JSON value count, and the step log's size."""
from __future__ import annotations

import json
import logging
import tracemalloc

import pytest

from homepd.core.protocol import StepRecord
from homepd.engine.requests import STEP_LOG_BYTES, step_log_len
from homepd.errors import ConfigError
from homepd.serve.connections import FDS_RESERVED, RateLimitedLog, connection_limit
from homepd.serve.middleware import count_json_values, host_name
from homepd.serve.settings import ServeSettings


@pytest.mark.parametrize("key", [" " * 12, "  padded-key-123", "key-with-newline\n", "tab\tinside-key"])
def test_an_api_key_no_header_can_carry_is_refused(key):
    with pytest.raises(ConfigError, match="API key"):
        ServeSettings(api_key=key).validated()


def test_the_connection_limit_stays_below_the_descriptor_limit():
    assert connection_limit(1000, 1024) == 1024 - FDS_RESERVED
    assert connection_limit(1000, 65536) == 1000
    assert connection_limit(1000, 64) == 1


def test_repeated_log_lines_pass_once_per_period_and_say_how_many_were_held():
    records = [logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource",
                                 None, None) for _ in range(1000)]
    limit = RateLimitedLog(period_s=3600)
    assert sum(limit.filter(r) for r in records) == 1
    limit = RateLimitedLog(period_s=0.0)
    limit.filter(records[0])
    assert all(limit.filter(r) for r in records[1:3])


@pytest.mark.parametrize("obj,n_values", [({"a": [1, 2, {"b": 'x,{["y'}]}, 5), (['\\",', 1], 2),
                                          ({"m": [{"role": "user"}] * 50}, 101), ({"s": "\\\\"}, 1), ([], 1)])
def test_json_values_are_counted_outside_strings(obj, n_values):
    assert count_json_values(json.dumps(obj).encode(), 10**9) == n_values


def test_counting_stops_just_past_the_bound():
    body = json.dumps([{"role": "user"}] * 100_000).encode()
    assert 10 < count_json_values(body, 10) < 20


def test_host_names_lose_their_port():
    assert [host_name(h) for h in ("127.0.0.1:8439", "[::1]:80", "LOCALHOST", "evil.com:1", "::1")] == \
        ["127.0.0.1", "::1", "localhost", "evil.com", "::1"]


@pytest.mark.parametrize("n_seq_max", [1, 8, 32])
def test_a_full_step_log_of_worst_case_steps_fits_its_byte_bound(n_seq_max):
    ids = [f"chatcmpl-{i:032x}" for i in range(n_seq_max)]
    n = 2000
    tracemalloc.start()
    steps = [StepRecord("decode", i, i * 0.1, i * 0.1 + 0.05, tuple(ids), tuple((rid, 100 + i) for rid in ids),
                        512, 4096 + i) for i in range(n)]
    per_step_bytes = tracemalloc.get_traced_memory()[0] / n
    tracemalloc.stop()
    assert len(steps) == n and step_log_len(n_seq_max) * per_step_bytes <= STEP_LOG_BYTES
