"""``python -m e2e.node up|down|status|measure`` (``make cluster-up`` / ``make cluster-down``)."""

from __future__ import annotations

import argparse
import pathlib
import sys

from e2e.node import config, lifecycle, stack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.node")
    parser.add_argument("command", choices=["up", "down", "status", "measure"])
    parser.add_argument("--dir", type=pathlib.Path, default=stack.REPO / ".cluster")
    parser.add_argument("--no-build", action="store_true", help="use the cached builds as they are")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of idle CPU measured")
    args = parser.parse_args(argv)
    if args.command == "up":
        node = lifecycle.up(args.dir, build=not args.no_build)
        print(lifecycle.report(node, window=args.window))
        print(f"node up: export KUBECONFIG={node.paths.kubeconfig}")
        return 0
    if args.command == "down":
        print("node stopped" if lifecycle.down(args.dir) else "no node recorded")
        return 0
    found = stack.attach(config.Paths(state=args.dir.resolve()))
    healthy = found is not None and stack.healthy(found)
    if args.command == "measure" and found is not None and healthy:
        print(lifecycle.report(found, window=args.window))
    print(f"node {'up' if healthy else 'down'}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
