"""Command line of the runtime: `moe-runtime serve ...`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="serve a model over HTTP (not implemented yet)")
    args = parser.parse_args(argv)
    print(f"moe-runtime: '{args.command}' is not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
