"""The authenticated P/D plane on real vLLM (docs/security.md): P, D and the router share a
secret, the router has an API key of its own.

Checks that the sealed stack still takes every prompt token from P and answers exactly as a
single instance; that the router refuses requests without its key and keeps health open;
that a decode leg sent straight to D naming a P the router did not sign never makes D open
a connection there (a listener on that address sees none) and is computed locally with the
reason in the response; and that a forged side-channel request gets no answer while P keeps
serving. Forged and replayed notifications over real NIXL are in
tests/integration/test_push_loopback_auth.py.

First, on a D of its own (``untrusted_leg: refuse`` is a configuration of D, and the
sealed stack's D computes untrusted legs locally): a refused leg ends in vLLM's error,
computes nothing and dials nothing, and D keeps serving. It runs, and stops its server,
before the sealed stack starts, so no more than two servers run at once.
"""

from __future__ import annotations

import secrets
import select
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from connector.tools.pdstack import PdStack
from connector.tools.stack import VllmServer, free_port
from connector.transport.sidechannel_wire import KIND_EXCHANGE, encode_frame
from tests.e2e.conftest import HTTP_TIMEOUT_S, START_TIMEOUT_S, Pd, pd_clients
from tests.e2e.greedy import assert_matches_reference, greedy_body
from tests.e2e.test_push_e2e import (
    decode_leg,
    post_ok,
    probe_prefill,
    random_prompt,
    reference,
    settled_source_tokens,
    source_tokens,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

API_KEY = "sk-pushkv-e2e-" + secrets.token_hex(8)
NO_CONNECTION_WAIT_S = 2.0
REFUSED = "refused (untrusted_leg: refuse)"  # connector/scheduler_side.py's reason
COUNTERS_SETTLE_S = 10.0


def _secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    secret = tmp_path_factory.mktemp("secret") / "pd.secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    return secret


@pytest.fixture
def refusing_decode(
    tiny_model: Path, e2e_log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmServer, httpx.Client]]:
    """A D alone (no P: a refused leg dials nothing) with a secret and untrusted_leg:
    refuse, which needs vLLM's kv_load_failure_policy "fail"."""
    extra = {"auth_secret_file": str(_secret_file(tmp_path_factory)), "untrusted_leg": "refuse"}
    server = VllmServer(
        tiny_model,
        free_port(),
        kv_transfer_config={
            "kv_connector": "PushConnector",
            "kv_connector_module_path": "connector",
            "kv_role": "kv_consumer",
            "engine_id": "decode",
            "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": extra,
        },
        env={"VLLM_CPU_OMP_THREADS_BIND": "1", "OTEL_SDK_DISABLED": "true"},
        log_path=e2e_log_dir / "decode-refusing.log",
    )
    server.start()
    try:
        server.wait_healthy(START_TIMEOUT_S)
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT_S, trust_env=False) as d:
            yield server, d
    finally:
        server.stop()


def _local_compute_reaches(d: httpx.Client, at_least: float) -> float:
    """D's local_compute prompt tokens once they reach ``at_least`` (they may trail the
    response), or as they are after COUNTERS_SETTLE_S."""
    deadline = time.monotonic() + COUNTERS_SETTLE_S
    while True:
        now = source_tokens(d)["local_compute"]
        if now >= at_least or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def test_a_refused_leg_is_an_error_that_computes_and_dials_nothing(
    refusing_decode: tuple[VllmServer, httpx.Client],
) -> None:
    """untrusted_leg: refuse, straight to D's API: vLLM's error (500; vLLM 0.32's connector
    API has no 4xx), no connection to the address the leg named, no prompt token computed,
    the reason in D's log; then D serves a plain request."""
    server, d = refusing_decode
    before = source_tokens(d)["local_compute"]
    with socket.socket() as listener, socket.socket(type=socket.SOCK_DGRAM) as bell:
        port = free_port()
        listener.bind(("127.0.0.1", port))
        listener.listen(8)
        bell.bind(("127.0.0.1", port))
        coords = {"engine_id": "prefill", "host": "127.0.0.1", "port": port, "tp_size": 1}
        leg = decode_leg(coords, uuid.uuid4().hex)
        refused = d.post(
            "/v1/completions",
            json=greedy_body(random_prompt(120, seed=4300), kv_transfer_params=leg),
        )
        assert refused.status_code == 500, refused.text
        readable, _, _ = select.select([listener, bell], [], [], NO_CONNECTION_WAIT_S)
        assert readable == [], "D reached the address a refused leg named"
    log = server.log.read_text(errors="replace")
    assert REFUSED in log and "no valid router signature" in log, server.log
    # vLLM's API server resubmits the failed request pre-aborted, for cleanup: one leg.
    assert log.count(REFUSED) == 1, f"the refusal was logged more than once: {server.log}"
    plain = random_prompt(64, seed=4301)
    out = post_ok(d, "/v1/completions", greedy_body(plain, cache_salt=uuid.uuid4().hex))
    assert out["usage"]["completion_tokens"] > 0
    after = _local_compute_reaches(d, before + len(plain))
    assert after - before == len(plain), (
        f"D computed {after - before - len(plain):.0f} prompt tokens of the refused request"
    )


@pytest.fixture(scope="module")
def sealed(
    tiny_model: Path, e2e_log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pd]:
    """P, D and the router with one shared secret; the router with an API key."""
    secret = _secret_file(tmp_path_factory)
    auth = {"auth_secret_file": str(secret)}
    stack = PdStack(
        tiny_model,
        e2e_log_dir / "pd-sealed",
        prefill_extra_config=auth,
        decode_extra_config={**auth, "dial_timeout_s": 2.0},
        router_args=["--auth-secret-file", str(secret), "--api-key", API_KEY],
        tracing=False,
    )
    try:
        stack.start(START_TIMEOUT_S)
        with pd_clients(stack, {"Authorization": f"Bearer {API_KEY}"}) as clients:
            yield clients
    finally:
        stack.stop()


def test_sealed_stack_takes_the_kv_from_p_and_answers_as_one_instance(sealed: Pd) -> None:
    prompts = [random_prompt(n, seed=4000 + n) for n in (40, 300)]
    before = source_tokens(sealed.decode)
    outs = [post_ok(sealed.router, "/v1/completions", greedy_body(p)) for p in prompts]
    total = sum(len(p) for p in prompts)
    after = settled_source_tokens(sealed.decode, before["external_kv_transfer"] + total)
    delta = {k: after[k] - before[k] for k in after}
    assert delta["external_kv_transfer"] == total and delta["local_compute"] == 0, (
        f"D did not take every prompt token from P under the secret: {delta}; "
        f"logs in {sealed.stack.run_dir}"
    )
    for out, prompt in zip(outs, prompts, strict=True):
        assert "pushkv_error" not in (out.get("kv_transfer_params") or {}), out
        assert_matches_reference(out, reference(sealed, prompt), f"{len(prompt)}-token prompt")


def test_router_requires_its_key_except_on_health(sealed: Pd) -> None:
    with httpx.Client(base_url=sealed.stack.url, timeout=30, trust_env=False) as anonymous:
        assert anonymous.get("/health").status_code == 200
        refused = anonymous.post("/v1/completions", json=greedy_body("hello"))
        assert refused.status_code == 401, refused.text
        wrong = anonymous.post(
            "/v1/completions",
            json=greedy_body("hello"),
            headers={"Authorization": "Bearer not-the-key"},
        )
        assert wrong.status_code == 401, wrong.text
    assert sealed.router.post("/v1/completions", json=greedy_body("hello")).status_code == 200


def test_a_leg_naming_an_unsigned_p_never_dials_it(sealed: Pd) -> None:
    """Straight to D's public API, naming a listener of ours as P: no connection reaches it,
    the request is computed locally, and the response says why."""
    coords = probe_prefill(sealed)
    with socket.socket() as listener, socket.socket(type=socket.SOCK_DGRAM) as bell:
        port = free_port()
        listener.bind(("127.0.0.1", port))
        listener.listen(8)
        bell.bind(("127.0.0.1", port))  # D would ring a doorbell on the same port number
        fake = {**coords, "host": "127.0.0.1", "port": port, "ports": [port]}
        prompt = random_prompt(120, seed=4100)
        leg = decode_leg(fake, uuid.uuid4().hex)
        out = post_ok(sealed.decode, "/v1/completions", greedy_body(prompt, kv_transfer_params=leg))
        error = (out.get("kv_transfer_params") or {}).get("pushkv_error", "")
        assert "signature" in error, out
        readable, _, _ = select.select([listener, bell], [], [], NO_CONNECTION_WAIT_S)
        assert readable == [], "D reached the address an unsigned leg named"
    assert_matches_reference(out, reference(sealed, prompt), "unsigned leg, computed locally")


def test_a_forged_side_channel_request_gets_no_answer(sealed: Pd) -> None:
    coords = probe_prefill(sealed)
    forged = encode_frame(KIND_EXCHANGE, "forger", b"not nixl metadata")
    with socket.create_connection((coords["host"], coords["port"]), timeout=10) as conn:
        conn.sendall(forged)
        conn.settimeout(10)
        got = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break  # P closed the connection without a word
            got += chunk
    assert got == b"", f"P answered a forged request with {len(got)} bytes"
    prompt = random_prompt(64, seed=4200)
    out: dict[str, Any] = post_ok(sealed.router, "/v1/completions", greedy_body(prompt))
    assert_matches_reference(out, reference(sealed, prompt), "after a forged request")
