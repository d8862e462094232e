"""`make demo`: a local elastic MoE deployment on Kubernetes, resized while it serves.

Starts the real kube-apiserver + etcd (built from Go modules, cached), the local KubeRay
stand-in and the operator; applies `manifests/samples/moedeployment.yaml` (synthetic tiny
model, DP=2); runs a load generator whose every answer is checked token for token; then
`kubectl patch` 2→4 and `kubectl scale` 4→2, printing `kubectl get moed` as the stages pass;
ends with the per-stage durations of both resizes and the line `requests: ok=N failed=M`, and
stops everything it started.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import time

import yaml

from e2e import kube
from e2e import load as load_mod
from e2e.controlplane import cluster
from e2e.local import stack as stack_mod

NAMESPACE = "demo"
NAME = "tiny"
TIMEOUT_S = 600.0


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def get_moed(stack: stack_mod.LocalStack) -> str:
    return stack.kubectl("get", "moed", "-n", NAMESPACE).stdout.rstrip()


def follow(stack: stack_mod.LocalStack, dep: kube.Deployment, size: int) -> None:
    """Print `kubectl get moed` whenever its row changes, until DP=size is served."""
    last_key = None
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        header, row = get_moed(stack).splitlines()[:2]
        key = row.rsplit(None, 1)[0]  # the row without AGE
        if key != last_key:
            if last_key is None:
                print("    " + header)
            print("    " + row, flush=True)
            last_key = key
        if dep.serving(size):
            return
        time.sleep(0.25)
    raise TimeoutError(f"DP={size} was not reached within {TIMEOUT_S:.0f}s")


def timeline(dep: kube.Deployment) -> None:
    for record in dep.runtime_status()["history"]:
        stages = "  ".join(f"{s['stage']} {s['duration_s']:.2f}s" for s in record["stages"])
        print(
            f"    {record['from']}->{record['to']}: {record['duration_s']:.2f}s "
            f"(blackout {record['blackout_s'] * 1000:.0f} ms): {stages}"
        )
        if record["freed"]:
            print(f"      freed pods: {', '.join(f['pod'] for f in record['freed'])}")


def main() -> int:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="elastic-moe-demo-"))
    say("starting the local control plane (kube-apiserver + etcd)")
    plane = cluster.start(state_dir=workdir / "cluster")
    stack = stack_mod.LocalStack(plane=plane, workdir=workdir / "stack", namespace=NAMESPACE)
    lg: load_mod.Load | None = None
    try:
        say("starting the local KubeRay stand-in and the operator")
        stack.start()
        say(f"kubectl apply -f {stack_mod.SAMPLE.relative_to(stack_mod.REPO)}")
        stack.kubectl("apply", "-n", NAMESPACE, "-f", str(stack_mod.SAMPLE))
        dep = stack.deployment(NAME)
        follow(stack, dep, 2)
        source = yaml.safe_load(stack_mod.SAMPLE.read_text())["spec"]["model"]["source"]
        say(f"load: 4 clients, greedy completions checked against {source} in this process")
        lg = load_mod.Load(
            dep.endpoint,
            model_name=NAME,
            reference=load_mod.reference_tokens(source),
            clients=4,
        ).start()
        deadline = time.monotonic() + 120
        while lg.ok < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        say(f"serving: {lg.summary()}")
        say('kubectl patch moed tiny -p \'{"spec":{"dataParallelSize":4}}\'')
        body = json.dumps({"spec": {"dataParallelSize": 4}})
        stack.kubectl("patch", "moed", NAME, "-n", NAMESPACE, "--type=merge", "-p", body)
        follow(stack, dep, 4)
        say(f"grown to 4: {lg.summary()}")
        say("kubectl scale moed tiny --replicas=2")
        stack.kubectl("scale", "moed", NAME, "-n", NAMESPACE, "--replicas=2")
        follow(stack, dep, 2)
        settled = lg.ok + 8  # a few more answers at the final size
        deadline = time.monotonic() + 60
        while lg.ok < settled and lg.failed == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        lg.stop()
        say("resize timeline (from the runtime's /elastic_ep/status):")
        timeline(dep)
        for line in lg.failures[:10]:
            print(f"    failure: {line}")
        print(lg.summary(), flush=True)
        return 0 if lg.failed == 0 else 1
    finally:
        if lg is not None:
            lg.stop()
        say("stopping everything")
        stack.kubectl("delete", "raycluster", "--all", "-n", NAMESPACE, check=False)
        stack.stop()
        plane.stop()


if __name__ == "__main__":
    sys.exit(main())
