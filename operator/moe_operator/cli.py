"""Command line of the operator: `moe-operator run | crd`."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys

from moe_contract import logs as logs_contract


def _crd(args: argparse.Namespace) -> int:
    from moe_operator.api import crd

    for path in crd.write_crds(pathlib.Path(args.out)):
        print(path)
    return 0


def _run(args: argparse.Namespace) -> int:
    import kopf

    from moe_operator import handlers, logs, metrics, runtime_client

    if args.allow_runtime_url_override:
        os.environ[runtime_client.ALLOW_OVERRIDE_ENV] = "1"
    kopf.configure(verbose=args.verbose, debug=args.debug)
    if args.log_format == "json":
        logs.use_json()
    if args.metrics:
        handlers.METRICS_ADDRESS = metrics.parse_address(args.metrics)
    if not args.debug:  # one line per API request is too much at INFO
        logging.getLogger("httpx").setLevel(logging.WARNING)
        logging.getLogger("httpcore").setLevel(logging.WARNING)
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness,
    )
    del handlers  # imported for its registrations
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-operator")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the operator (kopf; KUBECONFIG or in-cluster config)")
    run.add_argument(
        "-n", "--namespace", action="append", help="watch only these namespaces (repeatable)"
    )
    run.add_argument(
        "--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz"
    )
    run.add_argument(
        "--metrics",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (e.g. 0.0.0.0:8081)",
    )
    run.add_argument(
        "--log-format",
        choices=logs_contract.FORMATS,
        default="text",
        help="json: one JSON object per line (time, level, logger, message, deployment, "
        "stage, resize_id)",
    )
    run.add_argument(
        "--allow-runtime-url-override",
        action="store_true",
        help="honour the elasticmoe.io/runtime-url annotation (local development only: the "
        "operator sends its admin token to that URL; env MOE_ALLOW_RUNTIME_URL_OVERRIDE=1)",
    )
    run.add_argument("--verbose", action="store_true")
    run.add_argument("--debug", action="store_true")
    run.set_defaults(func=_run)
    crd = sub.add_parser("crd", help="write the CRD YAML generated from the pydantic models")
    crd.add_argument("--out", default="crds/")
    crd.set_defaults(func=_crd)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
