"""Command line of the operator: `moe-operator run | crd`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-operator")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run the operator (not implemented yet)")
    crd = sub.add_parser("crd", help="write the CRD YAML")
    crd.add_argument("--out", default="crds/")
    args = parser.parse_args(argv)
    print(f"moe-operator: '{args.command}' is not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
