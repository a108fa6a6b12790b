"""Pure parts of ``homepd serve``: settings and the loopback rule, admission decisions, error shapes, timings,
systemd notifications, the unit installer."""
from __future__ import annotations

import socket
import types

import pytest

from homepd.config import EngineConfig
from homepd.core.lifecycle import Lifecycle, RequestState
from homepd.engine.topology import topology_for
from homepd.errors import ConfigError, PromptTooLongError
from homepd.serve.errors import APIError, describe_validation_errors, from_homepd_error
from homepd.serve.reply import timings
from homepd.serve.install import install_service, render_unit
from homepd.serve.openai_routes import request_class
from homepd.serve.service import Service
from homepd.serve.settings import ServeSettings, is_loopback
from homepd.serve.systemd import Notifier


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                            ("::", False), ("192.168.1.20", False), ("homebox.lan", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_non_loopback_address_needs_a_key():
    with pytest.raises(ConfigError, match="HOMEPD_API_KEY") as info:
        ServeSettings(host="0.0.0.0").validated()
    assert "refusing to listen on '0.0.0.0'" in str(info.value)
    assert ServeSettings(host="0.0.0.0", api_key="k" * 24).validated().host == "0.0.0.0"
    with pytest.raises(ConfigError, match="at least 8"):
        ServeSettings(api_key="short").validated()


class _Worker:
    def __init__(self, role="colocated", ready=True, failed=None):
        self.role, self.ready, self.failed = role, object() if ready else None, failed


def _service(mode="colocated", workers=(), **settings) -> Service:
    service = Service(EngineConfig(backend="fake", mode=mode, n_seq_max=2), ServeSettings(**settings))
    service.state = "ready"
    by_name = {w.role: w for w in workers}  # the engine's read API over these workers, by its topology's rule
    service.engine = types.SimpleNamespace(workers=by_name, tokenizer=None,
                                           health=lambda: topology_for(mode).health(by_name),
                                           restart_eta_s=lambda: None)
    return service


def _refusal(service: Service, rid: str = "r") -> APIError:
    with pytest.raises(APIError) as info:
        service.admit(rid, "interactive")
    assert info.value.status == 503 and "Retry-After" in info.value.headers
    return info.value


def test_admission_is_bounded_by_sequences_plus_queue():
    service = _service(workers=[_Worker()], max_queue=1)
    for rid in ("a", "b", "c"):
        service.admit(rid, "interactive")
    assert _refusal(service, "d").code == "queue_full"
    service.finished("a", None, "interactive")
    service.admit("d", "background")
    assert service.status()["admission"]["by_class"] == {"interactive": 2, "background": 1}


def test_503_reasons_starting_restarting_failed_draining():
    service = _service(workers=[_Worker()])
    service.state = "starting"
    assert _refusal(service).code == "not_ready"
    service.state = "ready"
    service.engine.workers["colocated"].ready = None  # died, restarting
    assert _refusal(service).code == "worker_restarting" and not service.is_ready
    service.engine.workers["colocated"].failed = "could not load"
    assert _refusal(service).code == "engine_failed"
    service = _service(workers=[_Worker()])
    service.state = "draining"
    assert _refusal(service).code == "draining"


def test_a_request_during_a_restart_waits_when_it_is_due_back_within_its_budget_else_503():
    service = _service(workers=[_Worker()])  # the interactive TTFT budget: 4 s, so 2 s may go to the restart
    service.engine.workers["colocated"].ready = None
    service.engine.restart_eta_s = lambda: 1.5
    service.admit("r", "interactive")                     # the engine holds it in the worker's backlog
    service.engine.restart_eta_s = lambda: 2.5
    refused = _refusal(service, "s")
    assert refused.code == "worker_restarting" and refused.headers["Retry-After"] == "3"
    service.admit("b", "background")                      # 120 s: a background request can wait that long
    assert "homepd_restart_arrivals_total{outcome=\"waited\"} 2.0" in service.metrics.exposition().decode()


def test_replicas_keep_serving_while_one_restarts():
    service = _service("replicas", [_Worker("replica0", ready=False), _Worker("replica1")])
    service.admit("r", "interactive")
    assert service.is_ready
    service.engine.workers["replica1"].failed = "gone"
    assert _refusal(service, "s").code == "worker_restarting"


def test_request_class_from_body_or_header():
    assert request_class(None, None) == "interactive"
    assert request_class("background", None) == "background"
    assert request_class(None, " Background ") == "background"
    with pytest.raises(APIError):
        request_class(None, "urgent")
    with pytest.raises(APIError):
        request_class("interactive", "background")


def test_validation_errors_name_the_field():
    message, param, code = describe_validation_errors([
        {"type": "extra_forbidden", "loc": ("body", "frequency"), "msg": "Extra inputs are not permitted"},
        {"type": "less_than_equal", "loc": ("body", "temperature"), "msg": "Input should be <= 2"}])
    assert param == "frequency" and code == "unsupported_field"
    assert "frequency: unsupported field" in message and "temperature: Input should be <= 2" in message
    assert describe_validation_errors([{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error",
                                        "ctx": {"error": "Expecting value"}}])[2] == "invalid_json"


def test_prompt_too_long_error_shape():
    body = from_homepd_error(PromptTooLongError(5000, 4096)).body()["error"]
    assert body["type"] == "exceed_context_size_error" and body["code"] == "context_length_exceeded"
    assert (body["n_prompt_tokens"], body["n_ctx"]) == (5000, 4096)


def test_timings_from_the_lifecycle_with_kv_handoff():
    lc = Lifecycle("r", arrived_s=10.0, n_prompt_tokens=100, request_class="background")
    lc.advance(RequestState.PREFILLING, 10.5)
    lc.prefill_end_s = 11.0
    lc.advance(RequestState.TRANSFERRING, 11.0)
    lc.kv_bytes, lc.kv_export_s, lc.kv_import_s = 2_000_000, 0.001, 0.002
    lc.transfer_end_s = 11.01
    lc.advance(RequestState.DECODING, 11.01)
    for t in (11.1, 11.2, 11.3):
        lc.add_token(t)
    lc.advance(RequestState.FINISHED, 11.3)
    t = timings(lc, "disaggregated")
    assert (t["mode"], t["request_class"], t["request_id"], t["state"]) == ("disaggregated", "background", "r",
                                                                             "finished")
    assert t["queue_wait_s"] == 0.5 and t["ttft_s"] == pytest.approx(1.1) and t["tpot_s"] == pytest.approx(0.1)
    assert t["prompt_tok_s"] == pytest.approx(200.0) and t["decode_tok_s"] == pytest.approx(10.0)
    assert t["kv_bytes"] == 2_000_000 and t["kv_transfer_s"] == pytest.approx(0.01)
    colocated = timings(Lifecycle("c", 0.0), "colocated")
    assert colocated["kv_bytes"] is None and colocated["kv_transfer_s"] is None  # same fields, none measured
    assert {k: v for k, v in t.items() if k != "mode"} == lc.timings().to_dict()   # one shape: the lifecycle's
    assert set(lc.to_dict()) >= set(lc.timings().to_dict())


def test_prompt_speed_counts_the_tokens_computed_not_those_reused_from_a_cached_prefix():
    lc = Lifecycle("turn-3", arrived_s=10.0, n_prompt_tokens=600)
    lc.n_cached_tokens = 580
    lc.advance(RequestState.PREFILLING, 10.0)
    lc.prefill_end_s = 10.25
    assert lc.timings().prompt_tok_s == pytest.approx(20 / 0.25)  # not 600 / 0.25


def test_notifier_sends_to_notify_socket_and_reads_the_watchdog_interval(tmp_path, monkeypatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "n.sock"))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    notifier = Notifier()
    assert notifier.watchdog_interval_s == 15.0
    notifier.ready("ready: colocated")
    notifier.watchdog()
    assert sock.recv(100) == b"READY=1\nSTATUS=ready: colocated" and sock.recv(100) == b"WATCHDOG=1"
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert Notifier().watchdog_interval_s is None  # meant for another process
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name)
    silent = Notifier()
    assert not silent.is_enabled and silent.watchdog_interval_s is None
    silent.ready("x")  # a no-op


def test_render_unit_points_execstart_at_this_homepd():
    unit = render_unit("/srv/homepd/.venv/bin/homepd")
    assert "\nExecStart=/srv/homepd/.venv/bin/homepd serve\n" in unit
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "DynamicUser=yes", "StateDirectory=homepd",
                 "ConfigurationDirectory=homepd", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                 "NoNewPrivileges=yes", "RestrictAddressFamilies=", "DeviceAllow=char-nvidia"):
        assert "\n" + line in unit, line


def test_install_writes_unit_and_keeps_existing_settings(tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as fh:
        install_service(dry_run=True, unit_dir=str(tmp_path / "units"), config_dir=str(tmp_path / "etc"),
                        executable="/opt/homepd/.venv/bin/homepd", out=fh)
    assert not (tmp_path / "units").exists() and "would write" in out.read_text()
    with open(out, "w") as fh:
        install_service(unit_dir=str(tmp_path / "units"), config_dir=str(tmp_path / "etc"),
                        executable="/opt/homepd/.venv/bin/homepd", out=fh, reload=False)
    env = tmp_path / "etc" / "homepd.env"
    assert "ExecStart=/opt/homepd/.venv/bin/homepd serve" in (tmp_path / "units" / "homepd.service").read_text()
    assert "HOMEPD_API_KEY" in env.read_text() and env.stat().st_mode & 0o777 == 0o640
    env.write_text("HOMEPD_MODEL=mine\n")
    with open(out, "w") as fh:
        install_service(unit_dir=str(tmp_path / "units"), config_dir=str(tmp_path / "etc"),
                        executable="/opt/homepd/.venv/bin/homepd", out=fh, reload=False)
    assert env.read_text() == "HOMEPD_MODEL=mine\n" and "keep" in out.read_text()


def test_install_refuses_a_homepd_under_home():
    with pytest.raises(ConfigError, match="ProtectHome"):
        install_service(dry_run=True, executable="/home/me/homepd/.venv/bin/homepd")
