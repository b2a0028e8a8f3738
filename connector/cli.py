"""The ``pushkv`` command. Subcommands import their modules lazily (cheap start)."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pushkv", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="push KV between a P and a D process over NIXL (loopback)")
    demo.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    demo.add_argument("--repeats", type=int, default=10)
    sub.add_parser("version", help="print the version")
    sub.add_parser("router", help="the P/D router (pushkv router --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["router"]:
        from connector.router import main as router_main

        return router_main(argv[1:])
    args = parser.parse_args(argv)
    if args.cmd == "version":
        from connector import __version__

        print(__version__)
        return 0
    if args.cmd == "demo":
        # Loopback only, unless the user already chose UCX transports.
        os.environ.setdefault("UCX_TLS", "tcp,sm,self")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        from connector.demo import run_demo

        run_demo(tuple(args.tokens), args.repeats)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
