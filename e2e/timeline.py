"""A picture of resizes under load: a PNG timeline that people look at instead of a table.

Top panel: tokens/s over time as the clients saw them (every streamed delta), split per rank
where the runtime says how the routed tokens spread over its ranks (``moe_rank_expert_load``:
each rank's share of token-to-expert assignments over its last 100 steps); the stages of every
resize (the runtime's ``/elastic_ep/status`` history) as coloured bands; the autoscaler's
decisions as marked lines. Bottom panel: the data-parallel size, and the in-flight sequences
per rank the autoscaler decides on. The title holds ``requests: ok=N failed=M``.

``Sampler`` polls the runtime's public ``GET /metrics`` while the load runs; ``Timeline`` holds
what the picture needs (JSON round trip, so a run can be drawn later); ``render`` draws it with
matplotlib (the ``test`` extra). Used by ``bench/resize.py``, ``make demo`` and the cluster
autoscaling test. Times are wall clock (``time.time()``): the runtime's records use it too.
"""

from __future__ import annotations

import calendar
import dataclasses
import json
import pathlib
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

#: Band colours of the resize stages (docs/RESIZE.md names).
STAGE_COLOURS = {
    "Provisioning": "#fee391",
    "Standby": "#9ecae1",
    "Transferring": "#6baed6",
    "Switching": "#fd8d3c",
    "Reshuffling": "#c7e9c0",
    "Migrating": "#fdd0a2",
    "Releasing": "#d9d9d9",
    "Recovering": "#fcbba1",
}
#: Colours of the ranks' shares (none of the stage colours).
RANK_COLOURS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
_SAMPLE = re.compile(r"^(moe_[a-z_]+)(?:\{([^}]*)\})? ([-+0-9.eE]+|NaN)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The ``moe_*`` samples of a Prometheus text page: name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        name, labels, value = match.groups()
        out.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), float(value)))
    return out


@dataclasses.dataclass
class Sample:
    """One look at the runtime's metrics."""

    time: float
    #: rank -> share of the token-to-expert assignments of the last 100 steps
    shares: dict[str, float]
    size: int | None
    in_flight: int | None


@dataclasses.dataclass
class Timeline:
    """Everything the picture shows (wall-clock seconds)."""

    title: str
    start: float
    end: float
    #: (time, tokens) of every streamed delta the clients received
    tokens: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    samples: list[Sample] = dataclasses.field(default_factory=list)
    #: the runtime's resize records (``/elastic_ep/status`` ``history``)
    resizes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: (time, label) of each autoscaler decision (e.g. "ScaledUp 1->2")
    decisions: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    ok: int = 0
    failed: int = 0
    #: the size before the first resize (when no sample says it)
    initial_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Timeline:
        fields = dict(data)
        fields["samples"] = [Sample(**s) for s in data.get("samples") or []]
        fields["tokens"] = [tuple(t) for t in data.get("tokens") or []]
        fields["decisions"] = [tuple(d) for d in data.get("decisions") or []]
        return cls(**fields)

    def save_json(self, path: pathlib.Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json()))

    def sizes(self) -> list[tuple[float, int]]:
        """The serving size over time: the samples' word, else the resize records'."""
        points = [(s.time, s.size) for s in self.samples if s.size is not None]
        if points:
            return [(t, int(n)) for t, n in points]
        size = self.initial_size
        out: list[tuple[float, int]] = [] if size is None else [(self.start, size)]
        for record in sorted(self.resizes, key=lambda r: float(r.get("started_at") or 0)):
            if record.get("stage") != "Completed" or record.get("duration_s") is None:
                continue
            if not out:
                out.append((self.start, int(record["from"])))
            out.append(
                (float(record["started_at"]) + float(record["duration_s"]), int(record["to"]))
            )
        return out


class Sampler:
    """Polls ``GET {url}/metrics`` every ``interval_s`` in a thread until stopped."""

    def __init__(self, url: Callable[[], str | None], *, interval_s: float = 1.0) -> None:
        self._url = url
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.is_set():
                url = self._url()
                if url is not None:
                    try:
                        text = client.get(f"{url}/metrics").text
                    except httpx.HTTPError:
                        text = ""
                    if text:
                        self.samples.append(sample_of(parse_metrics(text), time.time()))
                self._stop.wait(self.interval_s)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=10)


def sample_of(metrics: dict[str, list[tuple[dict[str, str], float]]], now: float) -> Sample:
    load = {
        labels.get("rank", "?"): value for labels, value in metrics.get("moe_rank_expert_load", [])
    }
    total = sum(load.values())
    shares = {rank: value / total for rank, value in load.items()} if total > 0 else {}

    def one(name: str) -> float | None:
        values = metrics.get(name)
        return values[0][1] if values else None

    size = one("moe_data_parallel_size")
    running, waiting = one("moe_requests_running"), one("moe_requests_waiting")
    in_flight = None if running is None else int(running + (waiting or 0))
    return Sample(
        time=now, shares=shares, size=None if size is None else int(size), in_flight=in_flight
    )


def _rate(
    tokens: Sequence[tuple[float, int]], start: float, end: float, bin_s: float
) -> tuple[list[float], list[float]]:
    count = max(1, int((end - start) / bin_s) + 1)
    bins = [0.0] * count
    for t, n in tokens:
        i = int((t - start) / bin_s)
        if 0 <= i < count:
            bins[i] += n
    # a centred moving average over 3 bins: streamed deltas come in bursts
    smooth = [
        sum(bins[max(0, i - 1) : i + 2]) / (len(bins[max(0, i - 1) : i + 2]) * bin_s)
        for i in range(count)
    ]
    return [i * bin_s for i in range(count)], smooth


def render(timeline: Timeline, path: pathlib.Path, *, bin_s: float = 1.0) -> pathlib.Path:
    """Draw ``timeline`` into the PNG ``path``; returns it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError as error:  # pragma: no cover - the test extra installs it
        raise RuntimeError(
            "drawing the timeline needs matplotlib: pip install 'elastic-moe[test]'"
        ) from error
    t0 = timeline.start
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(13, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]}
    )
    xs, rate = _rate(timeline.tokens, t0, timeline.end, bin_s)
    ranks = sorted({r for s in timeline.samples for r in s.shares}, key=lambda r: (len(r), r))
    if ranks and timeline.samples:
        # tokens/s split by each rank's share of the routed tokens at that moment
        shares = [_share_at(timeline.samples, t0 + x) for x in xs]
        layers = [[rate[i] * shares[i].get(r, 0.0) for i in range(len(xs))] for r in ranks]
        top.stackplot(
            xs,
            layers,
            labels=[f"rank {r}" for r in ranks],
            colors=[RANK_COLOURS[i % len(RANK_COLOURS)] for i in range(len(ranks))],
            alpha=0.4,
            linewidth=0,
            zorder=1,
        )
    top.plot(xs, rate, color="black", linewidth=1.2, label="tokens/s (clients)", zorder=3)
    top.set_ylabel("tokens/s")
    seen: set[str] = set()
    for record in timeline.resizes:
        for stage in record.get("stages") or []:
            began, took = stage.get("started_at"), stage.get("duration_s")
            if began is None or took is None or stage.get("stage") not in STAGE_COLOURS:
                continue
            name = stage["stage"]
            for ax in (top, bottom):
                ax.axvspan(
                    float(began) - t0,
                    float(began) + max(float(took), 0.2) - t0,
                    color=STAGE_COLOURS[name],
                    alpha=0.7,
                    linewidth=0,
                    zorder=0,
                    label=name if ax is top and name not in seen else None,
                )
            seen.add(name)
        if record.get("started_at") is not None:
            top.annotate(
                f"{record['from']}→{record['to']}",
                xy=(float(record["started_at"]) - t0, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, -12),
                zorder=4,
                textcoords="offset points",
                fontsize=8,
            )
    for when, label in timeline.decisions:
        for ax in (top, bottom):
            ax.axvline(when - t0, color="#7a0177", linestyle="--", linewidth=1)
        top.annotate(
            label,
            xy=(when - t0, 0.92),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize=8,
            color="#7a0177",
            ha="right",
            va="top",
        )
    sizes = timeline.sizes()
    if sizes:
        bottom.step(
            [t - t0 for t, _ in sizes] + [timeline.end - t0],
            [n for _, n in sizes] + [sizes[-1][1]],
            where="post",
            color="#084594",
            linewidth=2,
            label="data-parallel size",
        )
        bottom.set_ylim(0, max(n for _, n in sizes) + 1)
    bottom.set_ylabel("ranks")
    flight = [
        (s.time - t0, s.in_flight / s.size)
        for s in timeline.samples
        if s.in_flight is not None and s.size
    ]
    if flight:
        twin = bottom.twinx()
        twin.plot([t for t, _ in flight], [v for _, v in flight], color="#e6550d", linewidth=1,
                  label="in flight per rank")  # fmt: skip
        twin.set_ylabel("in flight / rank")
        twin.legend(loc="upper right", fontsize=8)
        twin.set_ylim(bottom=0)
    bottom.set_xlabel("seconds")
    bottom.legend(loc="lower right", fontsize=8)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    top.set_xlim(0, max(timeline.end - t0, 1.0))
    colour = "#b30000" if timeline.failed else "#006d2c"
    top.set_title(
        f"{timeline.title} — requests: ok={timeline.ok} failed={timeline.failed}",
        color=colour,
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _share_at(samples: Sequence[Sample], when: float) -> dict[str, float]:
    """The latest sample's shares at ``when`` (the first one before any)."""
    best = samples[0]
    for s in samples:
        if s.time <= when:
            best = s
        else:
            break
    return best.shares


def _event_time(event: dict[str, Any]) -> float:
    stamp = (
        event.get("eventTime")
        or event.get("firstTimestamp")
        or event["metadata"]["creationTimestamp"]
    )
    return float(calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")))


def provisioning(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operator's ``Provisioning`` stages (new worker pods; the runtime is asked only once
    they are ready, so its records start after them) from its stage events, as records
    ``render`` draws bands of: from the ``resize A->B: Provisioning`` event to the next event
    of that resize."""
    ordered = sorted(events, key=_event_time)
    out = []
    for i, event in enumerate(ordered):
        match = re.match(r"resize (\d+)->(\d+): Provisioning", event.get("message") or "")
        if event.get("reason") != "Provisioning" or match is None:
            continue
        prefix = f"resize {match.group(1)}->{match.group(2)}: "
        later = [e for e in ordered[i + 1 :] if (e.get("message") or "").startswith(prefix)]
        if not later:
            continue
        began, ended = _event_time(event), _event_time(later[0])
        out.append(
            {
                "from": int(match.group(1)),
                "to": int(match.group(2)),
                "stages": [
                    {"stage": "Provisioning", "started_at": began, "duration_s": ended - began}
                ],
            }
        )
    return out


def events_as_decisions(events: Sequence[dict[str, Any]]) -> list[tuple[float, str]]:
    """The autoscaler's ``ScaledUp`` / ``ScaledDown`` events (``kubectl get events -o json``
    items) as (time, label)."""
    out = []
    for event in events:
        if event.get("reason") not in ("ScaledUp", "ScaledDown"):
            continue
        moment = _event_time(event)
        match = re.search(r"dataParallelSize (\d+)->(\d+)", event.get("message") or "")
        label = event["reason"] + (f" {match.group(1)}→{match.group(2)}" if match else "")
        out.append((moment, label))
    return sorted(out)
