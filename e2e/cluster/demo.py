"""`make demo`: a live MoE deployment on the real node, resized while it serves.

Starts (or reuses) the real single-node cluster of `make cluster-up` — kubelet, containerd,
the real KubeRay operator and our operator as pods — then, as a user would: `kubectl apply`
of `manifests/samples/moedeployment.yaml` into a namespace enforcing Pod Security
`restricted`; a load generator through `kubectl port-forward` whose every answer (greedy,
seeded, streamed) is checked token for token; `kubectl patch` 2→4 and `kubectl scale` 4→2,
printing `kubectl get moed` as the stages pass. Then the load decides: `spec.autoscaling` is
switched on (15 s up, 45 s down window), the 4 clients ask for one rank (the operator shrinks
2→1 after the down window), 16 clients ask for two (it grows 1→2 after the up window). It ends
with the figures (apply → Ready, how soon the grow's new worker pods were Ready, each resize and
its stages, the stack's memory and idle CPU), a PNG timeline of the whole run
(out/demo-timeline.png: tokens/s per rank, stage bands, the autoscaler's decisions) and
`requests: ok=N failed=M`, and stops what it started.
"""

from __future__ import annotations

import json
import os
import sys
import time

import httpx

from e2e import kube, timeline
from e2e import load as load_mod
from e2e.cluster import conftest
from e2e.node import config, install, lifecycle, measure, stack

NAMESPACE = "demo"
NAME = "tiny"
TIMEOUT_S = 600.0
PICTURE = conftest.REPO / "out" / "demo-timeline.png"
#: The autoscaling act: windows short enough for a demo.
AUTOSCALING = {
    "enabled": True,
    "targetInFlightPerRank": 8,
    "scaleUpStabilizationSeconds": 15,
    "scaleDownStabilizationSeconds": 45,
    "syncPeriodSeconds": 2,
}


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def follow(dep: kube.Deployment, size: int, *, wide: bool = False) -> None:
    """Print `kubectl get moed` whenever its row changes, until DP=size is served."""
    last_key = None
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        args = ["get", "moed", "-n", NAMESPACE] + (["-o", "wide"] if wide else [])
        lines = dep.kubectl(*args).stdout.rstrip().splitlines()
        if len(lines) >= 2:
            header, row = lines[:2]
            key = row.rsplit(None, 1)[0]  # the row without AGE
            if key != last_key:
                if last_key is None:
                    print("    " + header)
                print("    " + row, flush=True)
                last_key = key
        if dep.serving(size) and len(dep.worker_pods()) == size:
            return
        time.sleep(0.5)
    raise TimeoutError(f"DP={size} was not reached within {TIMEOUT_S:.0f}s")


def print_timeline(dep: kube.Deployment) -> None:
    for record in dep.runtime_status()["history"]:
        stages = "  ".join(f"{s['stage']} {s['duration_s']:.2f}s" for s in record["stages"])
        print(
            f"    {record['from']}->{record['to']}: {record['duration_s']:.2f}s "
            f"(blackout {record['blackout_s'] * 1000:.0f} ms): {stages}"
        )
        if record.get("freed"):
            print(f"      freed pods: {', '.join(f['pod'] for f in record['freed'])}")


def main() -> int:
    state = conftest.REPO / ".cluster"
    already = stack.attach(config.Paths(state=state.resolve()))
    reused = already is not None and stack.healthy(already)
    say("the real node: " + ("reusing the running one" if reused else "starting it (cluster-up)"))
    node = lifecycle.up(state)
    forward: kube.PortForward | None = None
    lg: load_mod.Load | None = None
    surge: load_mod.Load | None = None
    sampler: timeline.Sampler | None = None
    try:
        node.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true")
        install.ensure_namespace(node, NAMESPACE, labels=conftest.RESTRICTED)
        say(f"kubectl apply -n {NAMESPACE} -f manifests/samples/moedeployment.yaml")
        applied = time.monotonic()
        node.kubectl("apply", "-n", NAMESPACE, "-f", str(conftest.SAMPLE))
        forward = kube.PortForward(node, namespace=NAMESPACE, target=f"svc/{NAME}-api", port=8000)
        dep = kube.Deployment(cluster=node, name=NAME, namespace=NAMESPACE, endpoint=forward.url)
        follow(dep, 2)
        ready_s = time.monotonic() - applied
        say(f"Serving at DP=2, {ready_s:.1f}s after kubectl apply")
        chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12}
        url = forward.url()
        assert url is not None
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).json()
        say(f"POST /v1/chat/completions: {answer['choices'][0]['message']['content']!r}")
        source = conftest.sample_model()
        say(f"load: 4 clients (greedy, seeded, streamed; up to 96 tokens) checked against {source}")
        reference = load_mod.reference_tokens(source)
        started = time.time()
        sampler = timeline.Sampler(forward.url, interval_s=1.0).start()
        lg = load_mod.Load(forward.url, model_name=NAME, reference=reference, clients=4).start()
        kube.wait_for(lambda: lg is not None and lg.ok >= 8, timeout_s=180, what="8 answers")
        say(f"serving: {lg.summary()}")
        say('kubectl patch moed tiny --type=merge -p \'{"spec":{"dataParallelSize":4}}\'')
        body = json.dumps({"spec": {"dataParallelSize": 4}})
        before = set(dep.worker_pods())
        dep.kubectl("patch", "moed", NAME, "-n", NAMESPACE, "--type=merge", "-p", body)
        follow(dep, 4)
        say(f"grown to 4: {lg.summary()}")
        new_pods = [p for p in dep.pods() if p["metadata"]["name"] not in before]
        delays = [kube.seconds_to_ready(p) for p in new_pods]
        say(f"new worker pods Ready {delays} s after their container started (our probe: 1 s)")
        say("kubectl scale moed tiny --replicas=2")
        dep.kubectl("scale", "moed", NAME, "-n", NAMESPACE, "--replicas=2")
        follow(dep, 2)
        say("the load decides: kubectl patch moed tiny --type=merge -p "
            f"'{json.dumps({'spec': {'autoscaling': AUTOSCALING}})}'")  # fmt: skip
        body = json.dumps({"spec": {"autoscaling": AUTOSCALING}})
        dep.kubectl("patch", "moed", NAME, "-n", NAMESPACE, "--type=merge", "-p", body)
        say("4 clients in flight on 2 ranks (2 per rank, target 8): it shrinks to 1 after 45 s")
        follow(dep, 1, wide=True)
        say("16 clients (12 more): 16 in flight on 1 rank: it grows to 2 after 15 s")
        surge = load_mod.Load(forward.url, model_name=NAME, reference=reference, clients=12)
        surge.start()
        follow(dep, 2, wide=True)
        surge.stop()
        settled = lg.ok + 8  # a few more answers at the final size
        kube.wait_for(
            lambda: lg is not None and (lg.ok >= settled or lg.failed > 0),
            timeout_s=120,
            what="answers at the final size",
        )
        lg.stop()
        sampler.stop()
        loads = [lg, surge]
        history = dep.runtime_status()["history"]
        picture = timeline.Timeline(
            title="make demo: 2→4→2 by hand, then the autoscaler (real node, real KubeRay)",
            start=started,
            end=time.time(),
            tokens=_wall(lg.token_times) + _wall(surge.token_times),
            samples=sampler.samples,
            resizes=history + timeline.provisioning(dep.events()),
            decisions=timeline.events_as_decisions(dep.events()),
            ok=lg.ok + surge.ok,
            failed=lg.failed + surge.failed,
            initial_size=2,
        )
        say("resize timeline (the runtime's /elastic_ep/status):")
        print_timeline(dep)
        say(f"figures: kubectl apply -> Ready {ready_s:.1f}s; the node's cost now:")
        print(measure.table(node, window=5.0))
        say(f"the timeline: {timeline.render(picture, PICTURE)}")
        for line in [*lg.failures, *surge.failures][:10]:
            print(f"    failure: {line}")
        failed = sum(x.failed for x in loads)
        print(f"requests: ok={sum(x.ok for x in loads)} failed={failed}", flush=True)
        return 0 if failed == 0 else 1
    except BaseException:
        say("the demo failed; what the cluster looks like:")
        conftest.diagnose(node, NAMESPACE, head_lines=200)
        raise
    finally:
        for running in (lg, surge):
            if running is not None:
                running.stop()
        if sampler is not None:
            sampler.stop()
        if forward is not None:
            forward.stop()
        say("cleaning up")
        node.kubectl("delete", "namespace", NAMESPACE, "--wait=true", check=False, timeout=180)
        if not reused and os.environ.get("MOE_KEEP_CLUSTER") != "1":
            say("stopping the node (cluster-down)")
            lifecycle.down(state)


def _wall(token_times: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The load's monotonic times as wall-clock times (the runtime's records use those)."""
    offset = time.time() - time.monotonic()
    return [(t + offset, n) for t, n in token_times]


if __name__ == "__main__":
    sys.exit(main())
