"""`moe-runtime` argument handling."""

from __future__ import annotations

import signal

import pytest

from moe_runtime import cli


def test_serve_defaults() -> None:
    args = cli.build_parser().parse_args(
        ["serve", "--model", "synthetic://tiny?seed=0", "--data-parallel-size", "2"]
    )
    assert (args.host, args.port, args.executor, args.num_redundant_experts) == (
        "127.0.0.1",
        8000,
        "ray",
        0,
    )


@pytest.mark.parametrize(
    ("flags", "auto_recover", "hang_timeout"),
    [
        pytest.param([], True, 3.0, id="default-grows-back"),
        pytest.param(["--no-auto-recover"], False, 3.0, id="no-auto-recover"),
        pytest.param(["--auto-recover", "--rank-hang-timeout", "1.5"], True, 1.5, id="explicit"),
    ],
)
def test_fault_tolerance_flags(flags: list[str], auto_recover: bool, hang_timeout: float) -> None:
    args = cli.build_parser().parse_args(
        ["serve", "--model", "m", "--data-parallel-size", "2", *flags]
    )
    assert (args.auto_recover, args.rank_hang_timeout) == (auto_recover, hang_timeout)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["serve", "--data-parallel-size", "2"], id="no-model"),
        pytest.param(
            ["serve", "--model", "m", "--data-parallel-size", "1", "--rank-hang-timeout", "0"],
            id="hang-timeout-0",
        ),
        pytest.param(["serve", "--model", "m", "--data-parallel-size", "0"], id="dp-0"),
        pytest.param(
            ["serve", "--model", "m", "--data-parallel-size", "1", "--executor", "mpi"],
            id="bad-executor",
        ),
        pytest.param(
            ["serve", "--model", "m", "--data-parallel-size", "1", "--num-redundant-experts", "-1"],
            id="negative-redundant",
        ),
    ],
)
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(argv)
    assert exc.value.code == 2


@pytest.mark.parametrize(
    ("model", "name"),
    [
        pytest.param("synthetic://tiny?seed=0", "tiny", id="synthetic"),
        pytest.param("/models/Mixtral-8x7B/", "Mixtral-8x7B", id="directory"),
    ],
)
def test_default_served_model_name(model: str, name: str) -> None:
    assert cli._default_name(model) == name


def test_backpressure_drain_and_token_flags() -> None:
    base = ["serve", "--model", "m", "--data-parallel-size", "2"]
    args = cli.build_parser().parse_args(base)
    assert (args.max_queued_requests, args.drain_timeout, args.admin_token_file) == (
        cli.DEFAULT_MAX_QUEUED,
        0,
        None,
    )
    assert not args.skip_tokenizer_init
    args = cli.build_parser().parse_args(
        [*base, "--max-queued-requests", "0", "--drain-timeout", "120"]
        + ["--admin-token-file", "/run/secrets/token", "--skip-tokenizer-init"]
    )
    assert (args.max_queued_requests, args.drain_timeout, args.admin_token_file) == (
        0,
        120,
        "/run/secrets/token",
    )
    assert args.skip_tokenizer_init


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--admin-token-file", "/nonexistent/token"], id="missing-token-file"),
        pytest.param(["--admin-token", "a", "--admin-token-file", "/x"], id="token-and-file"),
    ],
)
def test_serve_refuses_to_start_without_a_usable_token(flags: list[str]) -> None:
    argv = ["serve", "--model", "synthetic://tiny?seed=0", "--data-parallel-size", "1", *flags]
    handler = signal.getsignal(signal.SIGTERM)  # serve installs its own
    try:
        assert cli.serve(cli.build_parser().parse_args(argv)) == 1  # before any rank starts
    finally:
        signal.signal(signal.SIGTERM, handler)
