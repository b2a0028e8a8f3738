"""On a GPU: P's WRITE waits for the CUDA event of the step that computed the KV.

Run: python -m bench.gpu_ready_check [--device cuda:0] [--rounds 5]

The plugin hands P's blocks to the transfer thread right after the forward was *launched*
(worker_side.after_forward) with ``ready`` = a CUDA event recorded after it; the WRITE must
not read the blocks before the event fires. Here P's "forward" is a long chain of kernels
that ends by writing a final value into every block of the prompt; the prompt is handed
over at once with ``ready=event.query`` (as the plugin does), and D's blocks are checked:
every byte must be the final value. The control round hands the blocks over with no event
and must see stale bytes (it proves the check can fail). Also printed: the kernel chain's
length, when the transfer thread saw the event fire (P's ``prefill`` span end) against when
the GPU finished (host sync), and when the WRITE was posted.

P and D are two NIXL agents in this one process, each with its own transfer thread, over
UCX on loopback (cuda_copy/cuda_ipc for VRAM).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from connector.core import events as ev
from connector.tools.loopback import RankSpec, expected_event
from connector.transport.ports import free_port

FINAL = 7  # what P's last kernel writes into every block of the prompt


class Times:
    """Duck-typed span hooks (connector.transfer.spans.TransferSpans' interface): the times only."""

    def __init__(self) -> None:
        self.ready_ns: dict[str, int] = {}
        self.reports: dict[str, Any] = {}

    def prefill_ready(self, tid: str, at_ns: int) -> None:
        self.ready_ns[tid] = at_ns

    def prefill_submitted(self, event: Any, note: Any, deferred: bool) -> None:
        if not deferred:
            self.ready_ns[event.transfer_id] = time.time_ns()

    def write_finished(self, report: Any) -> None:
        self.reports[report.transfer_id] = report

    def __getattr__(self, _name: str) -> Any:
        return lambda *a, **k: None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chain", type=int, default=400, help="kernels before the final write")
    args = ap.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp,sm,self,cuda_copy,cuda_ipc")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import torch

    from connector.transfer.peers import Peers
    from connector.transfer.receiver import Receiver
    from connector.transfer.sender import Sender
    from connector.transfer.thread import TransferThread
    from connector.transfer.topology import RankInfo, Topology
    from connector.transport.nixl import NixlTransport

    shape = dict(num_layers=32, num_blocks=600, block_size=16, num_kv_heads=8, token_bytes=512)
    p_spec = RankSpec("P", "prefill", 0, 1, free_port(), device=args.device, **shape)
    d_spec = RankSpec("D", "decode", 0, 1, free_port(), device=args.device, **shape)
    p_buf, d_buf = p_spec.allocate(), d_spec.allocate()
    scratch = torch.randn(4096, 4096, device=args.device)
    times = Times()
    threads = []
    endpoints: dict[str, Any] = {}
    for spec, buf in ((p_spec, p_buf), (d_spec, d_buf)):
        layout = spec.layout(buf)
        t = NixlTransport(spec.agent, listen_port=spec.port)
        t.register_memory(layout.memory_extents(), layout.mem_type, layout.device_id)
        peers = Peers(t, 5_000_000_000)
        me = RankInfo(spec.engine_id, 0, 1, spec.addr)
        if spec.role == "P":
            ep = Sender(t, me, layout, Topology(8, 1), peers, spans=times)
            thread = TransferThread(t, peers, sender=ep, name="pushkv-P")
        else:
            ep = Receiver(me, layout, peers, spans=times)
            thread = TransferThread(t, peers, receiver=ep, name="pushkv-D")
        thread.start()
        threads.append(thread)
        endpoints[spec.role] = (t, thread)
    p_thread, d_thread = endpoints["P"][1], endpoints["D"][1]
    n_tokens, nb = 4096, 256
    failures = 0
    try:
        for r in range(args.rounds + 1):  # the last round is the control (no event)
            control = r == args.rounds
            tid = f"t{r}"
            p_blocks = tuple(range(nb))
            d_blocks = tuple(range(300, 300 + nb))
            d_buf.zero_()
            p_buf[:, :nb].fill_(1)  # stale content
            torch.cuda.synchronize()
            d_thread.submit(expected_event(tid, [p_spec], d_spec, d_blocks, n_tokens))
            t0 = time.time_ns()
            x = scratch
            for _ in range(args.chain):  # the "forward": long enough to outlast a WRITE
                x = torch.tanh(x @ scratch) * 0.5
            p_buf[:, :nb].fill_(FINAL)  # the KV the step computes, last
            event = torch.cuda.Event()
            event.record()
            launched = time.time_ns()
            ready = None if control else event.query
            p_thread.submit(ev.PrefillDone(tid, f"req-{tid}", (p_blocks,), n_tokens), ready=ready)
            torch.cuda.synchronize()
            gpu_done = time.time_ns()
            deadline = time.monotonic() + 30
            got = []
            while not got and time.monotonic() < deadline:
                got = d_thread.take_finished_recving()
                p_thread.take_finished_sending()
                time.sleep(0.001)
            assert got and got[0].ok, f"round {r}: D got {got}"
            view = d_buf[:, 300 : 300 + nb]
            final = int((view == FINAL).sum().item())
            total = view.numel()
            rep = times.reports[tid]
            seen = times.ready_ns.get(tid, 0)
            what = "control (no event)" if control else "with event"
            print(
                f"round {r} {what}: chain {(gpu_done - t0) / 1e6:.1f} ms on the GPU "
                f"(launch took {(launched - t0) / 1e6:.1f} ms); event seen "
                f"{(seen - gpu_done) / 1e6:+.2f} ms after the host sync; WRITE posted "
                f"{(rep.posted_ns - gpu_done) / 1e6:+.2f} ms after it, "
                f"{rep.bytes_total / 2**20:.0f} MiB in "
                f"{(rep.done_ns - rep.posted_ns) / 1e6:.2f} ms; "
                f"D holds the final bytes in {final}/{total}"
            )
            if control:
                if final == total:
                    print(
                        "  CONTROL FAILED: without the event the WRITE still saw final bytes;"
                        " the check proves nothing at this chain length"
                    )
                    failures += 1
            elif final != total or rep.posted_ns < gpu_done - 2_000_000:
                print("  FAILED: the WRITE read the blocks before the step's event fired")
                failures += 1
    finally:
        for thread in threads:
            thread.stop()
        for t, _ in endpoints.values():
            t.close()
    print("OK" if not failures else f"{failures} FAILURES")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
