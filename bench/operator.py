"""Operator benchmark: 100 MoEDeployments applied at once against a fresh local control plane.

Prints p50/p99 of the time from each MoEDeployment's creation to its RayCluster appearing (seen
through a watch), the time until all of them exist and have a status, and the operator's peak
RSS. A benchmark prints figures; it does not fail on a slow machine.

    .venv/bin/python bench/operator.py [--count 100]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

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
        custom = kubernetes.client.CustomObjectsApi(client)
        seen: dict[str, float] = {}
        watch_ready = threading.Event()
        all_seen = threading.Event()

        def watch_rayclusters() -> None:
            watcher = kubernetes.watch.Watch()
            listing = custom.list_namespaced_custom_object("ray.io", "v1", NAMESPACE, "rayclusters")
            watch_ready.set()
            for event in watcher.stream(
                custom.list_namespaced_custom_object,
                "ray.io",
                "v1",
                NAMESPACE,
                "rayclusters",
                resource_version=listing["metadata"]["resourceVersion"],
                timeout_seconds=300,
            ):
                if event["type"] == "ADDED":
                    seen.setdefault(event["object"]["metadata"]["name"], time.monotonic())
                    if len(seen) >= count:
                        all_seen.set()
                        watcher.stop()

        watcher_thread = threading.Thread(target=watch_rayclusters, daemon=True)
        watcher_thread.start()
        watch_ready.wait(30)

        created: dict[str, float] = {}

        def create(name: str) -> None:
            custom.create_namespaced_custom_object(
                "elasticmoe.io", "v1alpha1", NAMESPACE, "moedeployments", manifest(name)
            )
            created[name] = time.monotonic()

        names = [f"bench-{i:03d}" for i in range(count)]
        cpu0 = {
            "operator": cpu_seconds(proc.pid),
            "kube-apiserver": cpu_seconds(plane.pids["kube-apiserver"]),
            "etcd": cpu_seconds(plane.pids["etcd"]),
        }
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(create, names))
        t_applied = time.monotonic()
        all_seen.wait(300)
        t_all = max(seen.values()) if seen else float("nan")

        def statuses() -> int:
            items = custom.list_namespaced_custom_object(
                "elasticmoe.io", "v1alpha1", NAMESPACE, "moedeployments"
            )["items"]
            return sum(1 for i in items if (i.get("status") or {}).get("observedGeneration"))

        deadline = time.monotonic() + 120
        while statuses() < count and time.monotonic() < deadline:
            time.sleep(0.2)
        t_status = time.monotonic()

        latencies = [seen[n] - created[n] for n in names if n in seen]
        from_start = [seen[n] - t0 for n in names if n in seen]
        print(f"created {count} MoEDeployments in {t_applied - t0:.2f}s (16 client threads)")
        print(f"RayClusters seen: {len(seen)}/{count}")
        if latencies:
            print(
                "create -> RayCluster: "
                f"p50 {statistics.median(latencies) * 1000:.0f} ms, "
                f"p99 {percentile(latencies, 99) * 1000:.0f} ms, "
                f"max {max(latencies) * 1000:.0f} ms"
            )
            print(
                "first create -> RayCluster: "
                f"p50 {statistics.median(from_start) * 1000:.0f} ms, "
                f"p99 {percentile(from_start, 99) * 1000:.0f} ms"
            )
        print(
            f"all {count} RayClusters after {t_all - t0:.2f}s; all statuses after "
            f"{t_status - t0:.2f}s"
        )
        print(f"operator peak RSS: {peak_rss_mib(proc.pid):.0f} MiB (VmHWM)")
        used = {
            "operator": cpu_seconds(proc.pid) - cpu0["operator"],
            "kube-apiserver": cpu_seconds(plane.pids["kube-apiserver"]) - cpu0["kube-apiserver"],
            "etcd": cpu_seconds(plane.pids["etcd"]) - cpu0["etcd"],
        }
        print("CPU seconds during the run: " + ", ".join(f"{k} {v:.1f}" for k, v in used.items()))
        print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
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
