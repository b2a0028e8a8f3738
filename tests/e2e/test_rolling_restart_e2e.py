"""A rolling restart under load loses no request: 1 P and 2 D on the tiny model (the stack
the routing tests share, tests/e2e/shared_1p2d.py; this test runs after them) and a router of
its own with the default policy, clients sending all along; P is drained at the router and
SIGTERMed at once (its legs and pushes still in flight), restarted and undrained; then the same
for one D while the other serves. The clients hold (``Load.paused``) only while the restarted
server boots and takes its warm-up request, once as many answers as there are clients came
without it: their load there would only slow its boot (it shares the two cores with the
others).

vLLM runs with ``--shutdown-timeout 5`` (``connector.tools.stack``): on SIGTERM it takes no
new request and steps until those in flight end; pushkv's transfer thread finishes the WRITEs
already posted and, ``shutdown_grace_s`` later, ends every transfer still waiting with reason
``shutdown`` so its peer does not wait for a timeout (connector/shutdown.py). D runs
``kv_load_failure_policy: fail``: a load that failed is a 500 on the decode leg, which the
router retries, so a lost transfer would show as latency, a lost request as a failure.

Checked: every request answers 200 with the single instance's greedy answer (each request
has a cache salt of its own, so each is computed and pushed, never a prefix-cache hit); the
others answer while a server is down; no request takes longer than the baseline's slowest
plus ``EXTRA_BOUND_S``; P and the drained D are each used again once undrained (after one
warm-up request, as a readiness check would send: a fresh server's first requests are slow);
and each exits within ``STOP_BOUND_S`` of its SIGTERM. Every server is stopped by
``HostStack.stop`` by its process group's PID.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from connector.tools.hoststack import HostedServer, HostStack
from tests.e2e.clients import Load, http_client, wait_restarted, wait_until
from tests.e2e.greedy import assert_matches_reference, greedy_body
from tests.e2e.shared_1p2d import extra_router
from tests.e2e.test_push_e2e import post_ok, random_prompt

# Two restarts one after the other (and the three servers' start when this test runs alone):
# 7-10 min on the 2-core box shared with other engines (load ~20: starts of 130 s, restarts of
# 100-190 s); the soak's restart takes 40-60 s on an idle one.
pytestmark = [pytest.mark.e2e, pytest.mark.restarts_servers, pytest.mark.timeout(900)]

CLIENTS = 4
PROMPTS = 8  # distinct prompts (64 tokens), each request one of them under a fresh salt
PROMPT_TOKENS = 64
BASELINE_ANSWERS = 16
EXTRA_BOUND_S = 8.0  # vLLM's 5 s drain, the 2 s grace, a retry: a request never waits more
STOP_BOUND_S = 12.0  # SIGTERM to exit: vLLM's 5 s, its teardown; stop() SIGKILLs at 2x this
START_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 60.0
ADMIN = "/admin/backends"


@dataclass
class Answer:
    prompt: int
    started: float
    ended: float
    status: int | str  # an HTTP status, or the client's exception
    body: dict[str, Any] | None = None

    @property
    def took(self) -> float:
        return self.ended - self.started


@pytest.fixture
def stack(one_p_two_d: HostStack) -> HostStack:
    # The 1P2D of tests/e2e/shared_1p2d.py, after the routing tests (this test restarts its
    # servers); the test sends through a router of its own, with the default policy.
    return one_p_two_d


def _client(url: str) -> httpx.Client:
    return http_client(url, HTTP_TIMEOUT_S)


def _prompt(i: int) -> list[int]:
    return random_prompt(PROMPT_TOKENS, seed=100 + i)


def _send(c: httpx.Client, k: int, i: int) -> Answer:
    """Client ``k``'s ``i``-th request: one of PROMPTS under a fresh cache salt."""
    p = (k + i * CLIENTS) % PROMPTS
    body = greedy_body(_prompt(p), cache_salt=uuid.uuid4().hex)
    t0 = time.monotonic()
    try:
        r = c.post("/v1/completions", json=body)
        out = r.json() if r.status_code == 200 else None
        return Answer(p, t0, time.monotonic(), r.status_code, out)
    except (httpx.HTTPError, ValueError) as exc:
        return Answer(p, t0, time.monotonic(), repr(exc))


def _load(url: str) -> Load[Answer]:
    return Load(url, CLIENTS, _send, HTTP_TIMEOUT_S)


def _backend(router: httpx.Client, role: str, i: int) -> dict[str, Any]:
    entry: dict[str, Any] = router.get(ADMIN).json()[role][i]
    return entry


def _answered(load: Load[Answer], what: str, since: float | None = None) -> None:
    """As many answers as there are clients, to requests sent from ``since`` (now) on."""
    t = time.monotonic() if since is None else since
    wait_until(what, lambda: load.count(since=t) >= CLIENTS, 60)


def _restart(
    router: httpx.Client, load: Load[Answer], role: str, i: int, server: HostedServer
) -> tuple[float, str]:
    """Drain ``server`` at the router, SIGTERM it at once (legs in flight), start it again,
    warm it up and undrain it; wait until the router sends it a leg again. Returns when it
    was SIGTERMed and a line for the log."""
    r = router.post(f"{ADMIN}/{role}/{i}/drain")
    assert r.status_code == 200 and r.json()["draining"], r.text
    outstanding = _backend(router, role, i)["outstanding"]
    t0 = time.monotonic()
    server.stop(2 * STOP_BOUND_S)  # SIGTERM to its leader; SIGKILL only past the bound
    stopped = time.monotonic() - t0
    assert stopped < STOP_BOUND_S, f"{role} {i} took {stopped:.1f} s to shut down"
    # Answers meanwhile (by the other D, or by D alone for P).
    _answered(load, f"answers while {role} {i} is down", since=t0)
    server.log_path = server.log.with_name(f"{server.log.stem}-restarted.log")
    # The load holds while it boots and warms up: a boot that shares the cores with the
    # load only takes longer (the others serving without it is shown above).
    with load.paused():
        server.start()
        t1 = time.monotonic()
        wait_restarted(f"the restarted {role}", server, START_TIMEOUT_S)
        healthy = time.monotonic() - t1
        # Warmed up before it takes legs, as an operator's readiness check would: a fresh
        # server's first requests take seconds (13 s seen on a loaded box).
        tw = time.monotonic()
        with _client(server.url) as c:
            post_ok(c, "/v1/completions", greedy_body(random_prompt(20, seed=2)))
        warm = time.monotonic() - tw
    # Back to the steady load before it rejoins, and again before the next restart: not a
    # burst of the clients' first requests at the moment a server is drained and SIGTERMed.
    _answered(load, f"answers before {role} {i} is undrained")
    used = _backend(router, role, i)["dispatched"]
    r = router.post(f"{ADMIN}/{role}/{i}/undrain")
    assert r.status_code == 200 and not r.json()["draining"], r.text
    wait_until(
        f"a leg sent to the restarted {role}",
        lambda: _backend(router, role, i)["dispatched"] > used,
        60,
    )
    _answered(load, f"answers after {role} {i} is undrained")
    return t0, (
        f"{role} {i}: {outstanding} legs in flight at SIGTERM, exited in {stopped:.1f} s, "
        f"healthy {healthy:.1f} s after its start, warm {warm:.1f} s later; restart "
        f"{time.monotonic() - t0:.1f} s"
    )


def test_rolling_restart_of_p_then_d_under_load_loses_no_request(stack: HostStack) -> None:
    refs = []
    with _client(stack.decodes[1].url) as d:  # the single instance's greedy answers
        for p in range(PROMPTS):
            body = greedy_body(_prompt(p), cache_salt=uuid.uuid4().hex)
            refs.append(post_ok(d, "/v1/completions", body))
    notes, sigterms = [], []
    prefills, decodes = ([s.url for s in group] for group in (stack.prefills, stack.decodes))
    with (
        extra_router(stack, "rolling", prefills, decodes) as own,
        _client(own.url) as router,
    ):
        post_ok(router, "/v1/completions", greedy_body(random_prompt(20, seed=1)))  # warm-up
        with _load(own.url) as load:
            wait_until("the baseline's answers", lambda: load.count() >= BASELINE_ANSWERS, 120)
            baseline = [a for a in list(load.answers) if a.status == 200]
            slowest = max(a.took for a in baseline)
            for role, server in (("prefill", stack.prefills[0]), ("decode", stack.decodes[0])):
                at, note = _restart(router, load, role, 0, server)
                sigterms.append((role, at))
                notes.append(note)
            since = time.monotonic()
            wait_until(
                "answers after both restarts", lambda: load.count(since=since) >= CLIENTS, 60
            )
    answers = load.answers
    longest = max(a.took for a in answers)
    slow = sorted(answers, key=lambda a: a.took)[-3:]
    when = ", ".join(
        f"{a.took:.2f} s from "
        + " / ".join(f"{role} SIGTERM {a.started - at:+.2f} s" for role, at in sigterms)
        for a in slow
    )
    print(
        f"\n[rolling] {len(answers)} requests, baseline slowest {slowest:.2f} s, longest "
        f"{longest:.2f} s; " + "; ".join(notes) + f"; slowest three: {when}"
    )
    bad = [(a.status, round(a.took, 2)) for a in answers if a.status != 200]
    assert not bad, f"requests that failed during the rolling restart: {bad}"
    for n, a in enumerate(answers):
        assert a.body is not None
        at = " / ".join(f"{role} SIGTERM {a.started - t:+.2f} s" for role, t in sigterms)
        finish = a.body["choices"][0].get("finish_reason")
        what = f"request {n} (prompt {a.prompt}, took {a.took:.2f} s from {at}, {finish})"
        assert_matches_reference(a.body, refs[a.prompt], what)
    assert longest < slowest + EXTRA_BOUND_S, (
        f"a request took {longest:.2f} s (bound: the baseline's slowest {slowest:.2f} s "
        f"+ {EXTRA_BOUND_S} s)"
    )
