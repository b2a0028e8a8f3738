"""The ``pushkv`` command. Subcommands import their modules lazily (cheap start)."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pushkv", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser(
        "demo", help="real vLLM P and D on a tiny local model, through the router: TTFT, TPOT"
    )
    demo.add_argument("--requests", type=int, default=24)
    demo.add_argument("--concurrency", type=int, default=4)
    demo.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    demo.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    demo.add_argument(
        "--connector",
        default="PushConnector",
        choices=["PushConnector", "NixlConnector", "NixlPushConnector"],
        help="the KV connector P and D run (the router mode follows)",
    )
    demo.add_argument(
        "--keep",
        action="store_true",
        help="leave the stack running; print its URLs, PIDs and how to stop it",
    )
    demo.add_argument(
        "--run-dir",
        help="folder for the logs and traces (default: runs/demo-<time>, linked as runs/latest)",
    )
    demo.add_argument(
        "--hosts",
        action="store_true",
        help="2 P and 2 D (pushkv), each on a simulated host of its own (a network "
        "namespace; needs root), the router outside",
    )
    demo.add_argument(
        "--transport",
        action="store_true",
        help="the transport-only demo instead: a P and a D process pushing "
        "synthetic KV over NIXL (loopback), no vLLM",
    )
    demo.add_argument(
        "--tokens", type=int, nargs="+", default=[256, 1024, 4096], help="--transport: prompt sizes"
    )
    demo.add_argument("--repeats", type=int, default=10, help="--transport: rounds per size")
    sub.add_parser("version", help="print the version")
    sub.add_parser("router", help="the P/D router (pushkv router --help)", add_help=False)
    sub.add_parser(
        "bench",
        help="push vs vLLM's connectors under vllm bench serve (pushkv bench --help)",
        add_help=False,
    )
    sub.add_parser(
        "dashboard",
        help="the dashboard on a run folder (pushkv dashboard [RUN_DIR] [--port N])",
        add_help=False,
    )
    sub.add_parser(
        "drain",
        help="take a P or D out of rotation on every router and wait for its legs "
        "(pushkv drain --help)",
        add_help=False,
    )
    sub.add_parser(
        "collect",
        help="an OTLP/HTTP trace receiver writing JSON lines (pushkv collect --help)",
        add_help=False,
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["router"]:
        from connector.router import main as router_main

        return router_main(argv[1:])
    if argv[:1] == ["dashboard"]:
        from dashboard.launch import main as dashboard_main

        return dashboard_main(argv[1:])
    if argv[:1] == ["drain"]:
        from connector.router.drain_cli import main as drain_main

        return drain_main(argv[1:])
    if argv[:1] == ["collect"]:
        from telemetry.collector import main as collect_main

        return collect_main(argv[1:])
    if argv[:1] == ["bench"]:
        from connector.tools.bench.serve_bench import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.cmd == "version":
        from connector import __version__

        print(__version__)
        return 0
    if args.cmd == "demo" and args.transport:
        # Loopback only, unless the user already chose UCX transports.
        os.environ.setdefault("UCX_TLS", "tcp,sm,self")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        from connector.tools.transport_demo import run_transport_demo

        run_transport_demo(tuple(args.tokens), args.repeats)
        return 0
    if args.cmd == "demo":
        from pathlib import Path

        from connector.tools.demo import Workload, run_demo

        result = run_demo(
            Workload(args.requests, args.concurrency, args.input_len, args.output_len),
            keep=args.keep,
            run_dir=Path(args.run_dir) if args.run_dir else None,
            connector_name=args.connector,
            hosts=args.hosts,
        )
        return 0 if result["ok"] == result["requests"] else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
