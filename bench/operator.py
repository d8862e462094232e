"""Operator benchmark: N MoEDeployments applied at once against a fresh local control plane.

Prints p50/p99 of the time from each MoEDeployment's creation to its RayCluster appearing and
to its first status (both seen through watches, never by listing), the operator's peak RSS, the
CPU seconds of the operator, kube-apiserver, etcd and this process, and the API requests the
run caused (the apiserver's ``apiserver_request_total``, by verb and resource). CPU seconds per
deployment are the robust figure on a shared machine; latencies depend on its load (printed).
A benchmark prints figures; it does not fail on a slow machine.

    .venv/bin/python bench/operator.py [--count 100] [--profile out/operator.prof]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Final

import kubernetes

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e.controlplane import cluster  # noqa: E402

NAMESPACE = "bench"


def manifest(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "elasticmoe.io/v1alpha1",
        "kind": "MoEDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "synthetic://tiny?seed=0"},
            "dataParallelSize": 2,
            "minDataParallelSize": 1,
            "maxDataParallelSize": 4,
        },
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def peak_rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_REQUEST_LINE: Final = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
_LABEL: Final = re.compile(r'(\w+)="([^"]*)"')


def api_requests(plane: cluster.ControlPlane) -> collections.Counter[str]:
    """The apiserver's request counts so far, by ``VERB resource[/subresource]``."""
    text = plane.kubectl("get", "--raw", "/metrics").stdout
    counts: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        match = _REQUEST_LINE.match(line)
        if match is None:
            continue
        labels = dict(_LABEL.findall(match["labels"]))
        if labels.get("verb") == "WATCH" or not labels.get("resource"):
            continue
        sub = labels.get("subresource")
        what = labels["resource"] + (f"/{sub}" if sub else "")
        counts[f"{labels['verb']} {what}"] += int(float(match["value"]))
    return counts


def watch(
    custom: Any,
    group: str,
    version: str,
    plural: str,
    *,
    ready: threading.Event,
    on_event: Any,
) -> None:
    """Watch ``plural`` in the bench namespace from now on; ``on_event(type, object)`` returns
    True to stop. A watch that breaks (the apiserver ends it, a read times out under load) is
    started again from a full listing, so no object is missed (those are timed late)."""
    rv = custom.list_namespaced_custom_object(group, version, NAMESPACE, plural, limit=1)[
        "metadata"
    ]["resourceVersion"]
    ready.set()
    while True:
        watcher = kubernetes.watch.Watch()
        try:
            for event in watcher.stream(
                custom.list_namespaced_custom_object,
                group,
                version,
                NAMESPACE,
                plural,
                resource_version=rv,
                timeout_seconds=900,
            ):
                if on_event(event["type"], event["object"]):
                    watcher.stop()
                    return
        except Exception as error:  # noqa: BLE001 - a bench's watch must go on
            print(f"watch of {plural} broke ({type(error).__name__}: {error}); listing again")
        listing = custom.list_namespaced_custom_object(group, version, NAMESPACE, plural)
        for item in listing["items"]:
            if on_event("ADDED", item):
                return
        rv = listing["metadata"]["resourceVersion"]


def start_operator(
    plane: cluster.ControlPlane, log: pathlib.Path, *, profile: pathlib.Path | None = None
) -> subprocess.Popen[bytes]:
    env = {
        **plane.env(),
        "MOE_RESYNC_SECONDS": "3600",
        "PYTHONUNBUFFERED": "1",
        "MOE_OPERATOR_NAMESPACE": NAMESPACE,  # its key Secret lives there
    }
    with log.open("wb") as out:
        prefix = ["-m", "cProfile", "-o", str(profile)] if profile else []
        proc = subprocess.Popen(
            [sys.executable, *prefix, "-m", "moe_operator.cli", "run"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while "Initial authentication has finished" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"operator did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return proc


def run(count: int, *, profile: pathlib.Path | None = None) -> None:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="elastic-moe-bench-"))
    started = time.monotonic()
    plane = cluster.start(state_dir=workdir / "cp")
    print(f"control plane ready in {time.monotonic() - started:.1f}s at {plane.server}")
    plane.kubectl("create", "namespace", NAMESPACE)
    proc = start_operator(plane, workdir / "operator.log", profile=profile)
    try:
        client = kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig))
        client.rest_client.pool_manager.connection_pool_kw["maxsize"] = 32
        custom = kubernetes.client.CustomObjectsApi(client)
        seen: dict[str, float] = {}
        statused: dict[str, float] = {}
        all_seen = threading.Event()
        all_statused = threading.Event()

        def raycluster_event(kind: str, obj: dict[str, Any]) -> bool:
            if kind == "ADDED":
                seen.setdefault(obj["metadata"]["name"], time.monotonic())
            if len(seen) >= count:
                all_seen.set()
            return all_seen.is_set()

        def deployment_event(kind: str, obj: dict[str, Any]) -> bool:
            if (obj.get("status") or {}).get("observedGeneration"):
                statused.setdefault(obj["metadata"]["name"], time.monotonic())
            if len(statused) >= count:
                all_statused.set()
            return all_statused.is_set()

        watches = [
            (raycluster_event, ("ray.io", "v1", "rayclusters")),
            (deployment_event, ("elasticmoe.io", "v1alpha1", "moedeployments")),
        ]
        for on_event, resource in watches:
            ready = threading.Event()
            threading.Thread(
                target=watch,
                args=(custom, *resource),
                kwargs={"ready": ready, "on_event": on_event},
                daemon=True,
            ).start()
            ready.wait(30)

        created: dict[str, float] = {}

        def create(name: str) -> None:
            custom.create_namespaced_custom_object(
                "elasticmoe.io", "v1alpha1", NAMESPACE, "moedeployments", manifest(name)
            )
            created[name] = time.monotonic()

        names = [f"bench-{i:04d}" for i in range(count)]
        requests0 = api_requests(plane)
        load0 = os.getloadavg()
        cpu0 = {
            "operator": cpu_seconds(proc.pid),
            "kube-apiserver": cpu_seconds(plane.pids["kube-apiserver"]),
            "etcd": cpu_seconds(plane.pids["etcd"]),
            "bench": time.process_time(),
        }
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(create, names))
        t_applied = time.monotonic()
        limit = 60 + count * 0.5
        all_seen.wait(limit)
        all_statused.wait(max(1.0, limit - (time.monotonic() - t0)))
        used = {
            "operator": cpu_seconds(proc.pid) - cpu0["operator"],
            "kube-apiserver": cpu_seconds(plane.pids["kube-apiserver"]) - cpu0["kube-apiserver"],
            "etcd": cpu_seconds(plane.pids["etcd"]) - cpu0["etcd"],
            "bench": time.process_time() - cpu0["bench"],
        }
        load1 = os.getloadavg()
        requests = api_requests(plane)
        requests.subtract(requests0)
        t_all = max(seen.values()) if seen else float("nan")
        t_status = max(statused.values()) if statused else float("nan")

        def summary(moments: dict[str, float]) -> str:
            latencies = [moments[n] - created[n] for n in names if n in moments]
            if not latencies:
                return "none"
            return (
                f"p50 {statistics.median(latencies) * 1000:.0f} ms, "
                f"p99 {percentile(latencies, 99) * 1000:.0f} ms, "
                f"max {max(latencies) * 1000:.0f} ms"
            )

        print(f"created {count} MoEDeployments in {t_applied - t0:.2f}s (16 client threads)")
        print(f"RayClusters seen: {len(seen)}/{count}; statuses seen: {len(statused)}/{count}")
        print(f"create -> RayCluster: {summary(seen)}")
        print(f"create -> status: {summary(statused)}")
        print(
            f"all {count} RayClusters after {t_all - t0:.2f}s; all statuses after "
            f"{t_status - t0:.2f}s (from the first create)"
        )
        print(f"operator peak RSS: {peak_rss_mib(proc.pid):.0f} MiB (VmHWM)")
        print("CPU seconds during the run: " + ", ".join(f"{k} {v:.1f}" for k, v in used.items()))
        print(f"operator CPU per deployment: {used['operator'] / count * 1000:.1f} ms")
        total = sum(requests.values())
        print(
            f"API requests during the run: {total} ({total / count:.1f} per deployment): "
            + ", ".join(f"{k} {v}" for k, v in sorted(requests.items(), key=lambda kv: -kv[1]) if v)
        )
        failures = [
            line
            for line in (workdir / "operator.log").read_text(errors="replace").splitlines()
            if "failed" in line and "reconcile" in line
        ]
        print(
            f"operator log: {len(failures)} failed reconciles"
            + (f" (first: {failures[0][-300:]})" if failures else "")
        )
        print(
            "load average (1 min) before/after: "
            f"{load0[0]:.1f}/{load1[0]:.1f} on {os.cpu_count()} CPUs"
        )
        client.close()
    finally:
        proc.send_signal(2) if profile else proc.terminate()  # SIGINT lets cProfile write
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        plane.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument(
        "--profile", type=pathlib.Path, default=None, help="write the operator's cProfile here"
    )
    args = parser.parse_args()
    run(args.count, profile=args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
