"""Valid requests one transfer cannot carry (``n > 1``, ``best_of > 1``, a list of prompts) go
to D whole, the reason on the request span; never a 400 of the router's (issue #32)."""

from __future__ import annotations

import pytest

from connector.router import legs
from telemetry.schema import Attr, Span
from tests.unit.router.conftest import MakeCluster
from tests.unit.router.test_choice_and_modes import COMPLETION
from tests.unit.telemetry.memory import Recorder

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"n": 3}, "D alone: n = 3: one transfer feeds one sequence"),
        ({"best_of": 2}, "D alone: best_of = 2: one transfer feeds one sequence"),
        ({"prompt": ["a", "b", "c", "d"]}, "D alone: a list of 4 prompts: one transfer pairs"),
        ({"prompt": [[1, 2], [3, 4]]}, "D alone: a list of 2 prompts"),
    ],
)
async def test_goes_to_d_whole_with_the_reason_traced(
    cluster: MakeCluster, extra: dict[str, object], why: str
) -> None:
    rec = Recorder()
    c = await cluster(1, 1, tracer=rec.tracer)
    body = {**COMPLETION, **extra}
    r = await c.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert c.p[0].requests == []
    (seen,) = c.d[0].requests
    assert seen.body == body  # as the client sent it: no kv_transfer_params
    root = rec.one(Span.REQUEST)
    assert root.attributes[Attr.ROUTE_REASON.value].startswith(why)
    assert root.attributes[Attr.DEGRADED.value] is False  # P is fine: the request's own shape
    assert c.state.degraded == 0


def test_one_prompt_and_single_sequences_go_through_p_and_d() -> None:
    for body in (
        {"prompt": "x"},
        {"prompt": ["x"]},
        {"prompt": [1, 2, 3]},
        {"prompt": [[1, 2, 3]]},
        {"prompt": "x", "n": 1, "best_of": 1},
        {"prompt": "x", "n": True},  # not an int: D judges it
        {"prompt": "x", "n": "3"},
    ):
        assert legs.decode_alone_reason(body, legs.Endpoint.COMPLETIONS) is None, body
