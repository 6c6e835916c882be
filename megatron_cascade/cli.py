"""Command line: ``megatron-cascade run|eval|report|stages|convert``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-cascade", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a cascade config")
    run.add_argument("config")
    run.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    print(f"megatron-cascade {args.command}: not yet available", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
