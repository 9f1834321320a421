"""Command line: ``python -m fsdp_autocast_fix demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command."""
    parser = argparse.ArgumentParser(prog="python -m fsdp_autocast_fix")
    parser.add_argument("command", choices=["demo"], help="demo: the seed report's failure and its fix, on CPU")
    parser.parse_args(argv)
    from . import _demo

    return _demo.main()


if __name__ == "__main__":
    sys.exit(main())
