"""A stand-in ``python -m`` command for the client zygote's tests
(tests/unit/tools/test_client_zygote.py): says where and how it runs, then exits with the
code it is given, raises, or sleeps."""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    print(
        f"argv {sys.argv[1:]} cwd {os.getcwd()} parent {os.getppid()} "
        f"preloaded {'colorsys' in sys.modules}"
    )
    what, arg = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
    if what == "exit":
        sys.exit(int(arg))
    if what == "raise":
        raise RuntimeError(arg)
    if what == "sleep":
        time.sleep(float(arg))


if __name__ == "__main__":
    main()
