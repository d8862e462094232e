"""The seed's guard rails of the Ray executor (`executor.guards`): two Ray nodes behind one IP
are refused, a Ray without the compiled graph is refused at start-up in compiled mode, and the
head's relevant environment reaches every rank actor. No Ray instance: its calls are faked."""

from __future__ import annotations

from typing import Any

import pytest

from moe_contract import protocol
from moe_runtime.executor import guards, niceness, ray_actor, ray_start


def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reaching Ray fails at once (no local instance is started by these tests)."""
    from moe_runtime.executor import ray_executor

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the executor reached ray.init")

    monkeypatch.setattr(ray_executor.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_executor.ray, "init", refuse)


def _info(node: str, ip: str) -> dict[str, Any]:
    return {"node_id": node, "ip": ip, protocol.INFO_KEY: protocol.VERSION}


def test_two_nodes_behind_one_ip_are_refused_naming_them_and_the_setting() -> None:
    with pytest.raises(guards.NodeAddressError) as err:
        guards.check_node_ips([_info("node-a", "10.0.0.5"), _info("node-b", "10.0.0.5")])
    message = str(err.value)
    assert "node-a" in message and "node-b" in message and "10.0.0.5" in message
    assert "--node-ip-address" in message and "RAY_NODE_IP_ADDRESS" in message


def test_ranks_on_one_node_share_its_ip_and_distinct_nodes_pass() -> None:
    guards.check_node_ips([_info("n1", "127.0.0.1"), _info("n1", "127.0.0.1")])
    guards.check_node_ips([_info("n1", "10.0.0.1")], existing=[_info("n2", "10.0.0.2")])


def test_a_grow_onto_a_node_with_a_running_ranks_ip_is_refused() -> None:
    with pytest.raises(guards.NodeAddressError, match="n1, n2"):
        guards.check_node_ips([_info("n2", "10.0.0.1")], existing=[_info("n1", "10.0.0.1")])


def test_a_ray_without_the_compiled_graph_is_refused_naming_version_and_way_out() -> None:
    with pytest.raises(guards.CompiledGraphUnavailable) as err:
        guards.check_compiled_graph(lambda: ("2.9.3", "missing ray.dag.MultiOutputNode"))
    assert "Ray 2.9.3" in str(err.value) and "MOE_STEP_MODE=remote" in str(err.value)
    with pytest.raises(guards.CompiledGraphUnavailable, match="older than 2.40"):
        guards.check_compiled_graph(lambda: ("2.35.0", None))
    guards.check_compiled_graph()  # the installed Ray has it


def test_compiled_mode_checks_ray_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_runtime.executor import ray_executor

    def refuse() -> None:
        raise guards.CompiledGraphUnavailable("no compiled graph")

    monkeypatch.setattr(guards, "check_compiled_graph", refuse)
    _no_ray(monkeypatch)
    with pytest.raises(guards.CompiledGraphUnavailable):
        ray_executor.RayExecutor(num_ranks=1, step_mode="compiled")


def test_rank_env_copies_log_and_collective_settings_but_not_per_worker_ones() -> None:
    head = {
        "MOE_LOG_LEVEL": "DEBUG",
        "MOE_LOG_FORMAT": "json",
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "HF_HOME": "/cache",
        "CUDA_VISIBLE_DEVICES": "0",
        "RAY_ADDRESS": "head:6379",
        "HOSTNAME": "head-0",
        "POD_IP": "10.0.0.1",
        "MOE_POD_IP": "10.0.0.1",
        "MOE_POD_NAME": "head-0",
        "MOE_TERMINATION_LOG": "/dev/termination-log",
        "MOE_ADMIN_TOKEN": "secret",
        "HF_TOKEN": "secret",
        "OMP_NUM_THREADS": "8",
        niceness.SETUP_HOOK_ENV: niceness.SPARE_SETUP_HOOK,
        "PATH": "/usr/bin",
    }
    assert guards.rank_env(head) == {
        "GLOO_SOCKET_IFNAME": "eth0",
        "HF_HOME": "/cache",
        "MOE_LOG_FORMAT": "json",
        "MOE_LOG_LEVEL": "DEBUG",
        "NCCL_SOCKET_IFNAME": "eth0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


class _Remote:
    """A fake Ray actor class: records each `.options(...)`; its actors answer `ready`."""

    def __init__(self, infos: list[dict[str, Any]] | None = None) -> None:
        self.options_seen: list[dict[str, Any]] = []
        self._infos = infos or []

    def options(self, **kwargs: Any) -> _Remote:
        self.options_seen.append(kwargs)
        return self

    def remote(self, **kwargs: Any) -> Any:
        info = self._infos[len(self.options_seen) - 1] if self._infos else {}
        return _FakeActor(info)


class _FakeActor:
    def __init__(self, info: dict[str, Any]) -> None:
        self.ready = _Method(info)
        self.execute_method = _Method(None)


class _Method:
    def __init__(self, value: Any) -> None:
        self.value = value

    def remote(self, *args: Any) -> Any:
        return self.value


class _PG:
    def ready(self) -> None:
        return None


def _fake_ray(
    monkeypatch: pytest.MonkeyPatch, infos: list[dict[str, Any]]
) -> tuple[_Remote, _Remote, list[Any]]:
    leaders, followers, killed = _Remote(infos), _Remote(), []
    monkeypatch.setattr(ray_actor, "RemoteRankActor", leaders)
    monkeypatch.setattr(ray_start.ray_tensor, "RemoteFollower", followers)
    monkeypatch.setattr(ray_actor.ray.util, "placement_group", lambda *a, **k: _PG())
    monkeypatch.setattr(ray_actor.ray.util, "remove_placement_group", lambda pg: None)
    monkeypatch.setattr(ray_actor.ray, "get", lambda refs, **k: refs)
    monkeypatch.setattr(ray_actor.ray, "kill", killed.append)
    monkeypatch.setattr(
        ray_start.ray_bundles, "options", lambda pg, i, gpu, extra: {"bundle": i, **extra}
    )
    monkeypatch.setattr(ray_start.ray_calls, "get_all", lambda refs, ranks, **k: list(refs))
    return leaders, followers, killed


def _start(**kwargs: Any) -> list[ray_actor.Member]:
    return ray_start.start_ranks(
        kwargs.pop("count", 2),
        first_label=0,
        use_gpu=False,
        dtype="auto",
        timeout=5.0,
        driver_node="n1",
        **kwargs,
    )


def test_start_ranks_refuses_two_nodes_behind_one_ip_and_releases_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, _, killed = _fake_ray(monkeypatch, [_info("n1", "10.0.0.1"), _info("n2", "10.0.0.1")])
    with pytest.raises(guards.NodeAddressError, match="n1, n2"):
        _start(existing=[])
    assert len(killed) == 2


def test_a_grow_onto_a_running_ranks_ip_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_ray(monkeypatch, [_info("n2", "10.0.0.1")])
    with pytest.raises(guards.NodeAddressError):
        _start(count=1, existing=[_info("n1", "10.0.0.1")])


def test_every_rank_actor_gets_the_head_env_and_a_spare_keeps_its_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A spare (or a pooled process) is a whole DP rank: its TP followers start below the
    serving ranks' priority with its leader (the same process setup hook)."""
    leaders, followers, _ = _fake_ray(monkeypatch, [_info("n1", "127.0.0.1")])
    env = {"NCCL_DEBUG": "INFO"}
    _start(count=1, existing=[], env=env, spare=True, tp_size=2)
    hook = {niceness.SETUP_HOOK_ENV: niceness.SPARE_SETUP_HOOK}
    assert leaders.options_seen[0]["runtime_env"] == {"env_vars": {**env, **hook}}
    assert followers.options_seen[0]["runtime_env"] == {"env_vars": {**env, **hook}}


def test_without_head_env_a_serving_rank_gets_no_runtime_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leaders, followers, _ = _fake_ray(monkeypatch, [_info("n1", "127.0.0.1")])
    _start(count=1, existing=[], env={}, tp_size=2)
    assert "runtime_env" not in leaders.options_seen[0]
    assert "runtime_env" not in followers.options_seen[0]


def test_serve_on_a_ray_without_compiled_graph_fails_its_start_saying_why(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import signal

    from moe_contract import loading
    from moe_runtime import cli
    from moe_runtime.executor import cluster
    from tests.support import checkpoints

    log = tmp_path / "termination-log"
    log.write_text("")
    monkeypatch.setenv(loading.TERMINATION_LOG_ENV, str(log))
    monkeypatch.delenv("MOE_STEP_MODE", raising=False)
    monkeypatch.setattr(cluster, "connect", lambda **k: False)  # no Ray instance
    monkeypatch.setattr(cluster, "disconnect", lambda: None)
    _no_ray(monkeypatch)
    real = guards.check_compiled_graph
    monkeypatch.setattr(
        guards, "check_compiled_graph", lambda: real(lambda: ("2.9.3", "missing ray.dag"))
    )
    checkpoints.build(tmp_path / "model")
    argv = ["serve", "--model", str(tmp_path / "model"), "--executor", "ray", "--port", "0"]
    argv += ["--data-parallel-size", "1"]
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert cli.serve(cli.build_parser().parse_args(argv)) == 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    message = log.read_text()
    assert "CompiledGraphUnavailable" in message and "Ray 2.9.3" in message
    assert "MOE_STEP_MODE=remote" in message
    assert "MOE_STEP_MODE=remote" in capsys.readouterr().err


def test_a_grows_rank_takes_the_serving_priority_from_its_first_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ranks started beside serving ones (a grow, a recovery's grow-back) run the grow hook
    (`niceness.grow_setup`) in every process of the DP rank: a worker that began at Ray's
    default niceness 15 beside busy ranks would otherwise import for minutes while the
    resize waits."""
    serving = _info("n1", "127.0.0.1")
    leaders, followers, _ = _fake_ray(monkeypatch, [_info("n1", "127.0.0.1")])
    _start(count=1, existing=[serving], env={}, tp_size=2)
    hook = {niceness.SETUP_HOOK_ENV: niceness.GROW_SETUP_HOOK}
    assert leaders.options_seen[0]["runtime_env"] == {"env_vars": hook}
    assert followers.options_seen[0]["runtime_env"] == {"env_vars": hook}


def test_the_grow_hook_sets_the_serving_niceness(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int, int]] = []
    monkeypatch.setattr(niceness.os, "getpriority", lambda which, who: 15)
    monkeypatch.setattr(niceness.os, "setpriority", lambda *a: seen.append(a))
    module, name = niceness.GROW_SETUP_HOOK.rsplit(".", 1)
    assert module == niceness.__name__
    getattr(niceness, name)()
    assert seen and {n for _, _, n in seen} == {niceness.SERVING_NICENESS}
