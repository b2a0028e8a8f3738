"""``pushkv drain`` against real routers (in-loop, with mock backends): drained and idle on
every router it names (exit 0), legs still in flight past ``--wait`` (1), a router refusing
or unreachable (2), and ``--undrain``."""

from __future__ import annotations

import asyncio

import pytest

from connector.cli import main as cli_main
from connector.router.drain_cli import DRAINED, FAILED, IN_FLIGHT, change
from connector.transport.ports import free_port
from tests.unit.router.conftest import MakeCluster
from tests.unit.router.serving import within
from tests.unit.router.test_choice_and_modes import COMPLETION

pytestmark = pytest.mark.anyio
KEY = "admin-key-123"


async def test_drains_on_every_router_and_waits_for_the_legs_in_flight(
    cluster: MakeCluster,
) -> None:
    one, two = await cluster(1, 2), await cluster(1, 2)
    d0 = one.d_servers[0].url  # two routers, each its own backends: d0 named by URL on one,
    one.d[0].gate = asyncio.Event()  # by index on the other
    first = asyncio.create_task(one.client.post("/v1/completions", json=COMPLETION))
    await one.d[0].wait_for(1, "a request at router one's d0")

    drain = asyncio.create_task(change([one.router.url], "decode", d0, wait_s=60))
    code, lines = await change([two.router.url], "decode", "0", wait_s=60)
    assert (code, lines) == (DRAINED, [f"{two.router.url}: decode 0 drained, 0 leg(s) in flight"])
    assert not drain.done()  # router one's d0 still holds its leg
    one.d[0].gate.set()
    code, lines = await within(drain, "the drain once d0's leg ended")
    assert code == DRAINED and lines == [
        f"{one.router.url}: decode {d0} drained, 0 leg(s) in flight"
    ]
    assert (await within(first, "the request in flight")).status_code == 200
    assert one.state.backends.decode[0].load.draining and two.state.backends.decode[0].load.draining

    code, _ = await change([one.router.url, two.router.url], "decode", "0", undrain=True)
    assert code == DRAINED
    assert not one.state.backends.decode[0].load.draining
    assert not two.state.backends.decode[0].load.draining


async def test_exit_codes_say_in_flight_refused_and_unreachable(cluster: MakeCluster) -> None:
    c = await cluster(1, 1, api_key=KEY)
    c.d[0].gate = asyncio.Event()
    auth = {"Authorization": f"Bearer {KEY}"}
    first = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION, headers=auth))
    await c.d[0].wait_for(1, "a request at d0")

    code, (line,) = await change([c.router.url], "decode", "0", wait_s=0.05, api_key=KEY)
    assert code == IN_FLIGHT and "409 decode[0]" in line and "1 leg(s) still in flight" in line
    code, (line,) = await change([c.router.url], "decode", "0", wait_s=0)  # no key
    assert code == FAILED and line.startswith(f"{c.router.url}: 401")
    code, (line,) = await change([c.router.url], "decode", "7", api_key=KEY)
    assert code == FAILED and "404" in line and "no decode backend '7'" in line
    nowhere = f"http://127.0.0.1:{free_port()}"
    code, lines = await change([c.router.url, nowhere], "decode", "0", wait_s=0, api_key=KEY)
    assert code == FAILED and lines[1].startswith(f"{nowhere}: ConnectError")
    c.d[0].gate.set()
    assert (await within(first, "the request in flight")).status_code == 200


def test_the_command_line_refuses_what_it_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["drain", "--role", "decode", "--backend", "0"],  # no router
        ["drain", "--router", "http://r", "--role", "router", "--backend", "0"],
        ["drain", "--router", "http://r", "--role", "decode", "--backend", "0", "--wait", "-1"],
    ):
        with pytest.raises(SystemExit) as exc:
            cli_main(argv)
        assert exc.value.code == 2, argv
    assert "--wait must be 0 or more seconds" in capsys.readouterr().err
