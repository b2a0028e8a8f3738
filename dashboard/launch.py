"""Starting the dashboard on a run folder: ``command(run_dir)`` for ``make demo`` / ``pushkv``.

    python -m dashboard.launch runs/latest [--port 8501]

Binds 127.0.0.1 only (the traces stay on this machine); headless, no usage statistics.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

APP = Path(__file__).resolve().parent / "app.py"
DEFAULT_PORT = 8501


def command(
    run_dir: str | os.PathLike[str], port: int = DEFAULT_PORT, address: str = "127.0.0.1"
) -> list[str]:
    """The argv that serves the dashboard on ``run_dir`` at http://address:port."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.address",
        address,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--server.enableStaticServing",
        "true",  # dashboard.views.chart's light bundle
        "--client.toolbarMode",
        "minimal",  # no "Deploy" button
        "--",
        "--run-dir",
        str(Path(run_dir).resolve()),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pushkv dashboard", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", nargs="?", default=os.environ.get("PUSHKV_RUN_DIR", "runs/latest"))
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    args = ap.parse_args(argv)
    print(f"dashboard: http://127.0.0.1:{args.port}  (run folder {args.run_dir})", flush=True)
    return subprocess.call(command(args.run_dir, args.port))


if __name__ == "__main__":
    raise SystemExit(main())
