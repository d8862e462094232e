"""The prepared GPU check (`bench/gpu_check.sh`) runs its dry run on the CPU: every stage runs
and its figures are sane, so the script a lent GPU runs has not rotted."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

from bench import gpu_check

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_run_runs_every_stage(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = report["stages"]
    assert report["dry_run"] and list(stages) == list(gpu_check.STAGES)
    assert all(s["ok"] for s in stages.values()), {n: s.get("error") for n, s in stages.items()}
    forward = stages["forward"]  # float32 on the CPU: transformers' numbers, its tokens
    assert forward["logits_rel_error"] < 1e-4 and forward["token_agreement"] == 1.0
    for batch in ("1", "16", "64"):
        figures = stages["step"]["batches"][batch]
        assert figures["step_ms"] > 0 and figures["tokens_per_s"] > 0
    assert len(stages["lifecycle"]["after_each_mb"]) == 5
    abort = stages["abort"]
    assert abort["alive"] and "was lost" in abort["raised"] and abort["new_group_sum"] == 3.0
    serve = stages["serve"]
    assert serve["streams"] == 16 and serve["tokens"] == 16 * 8 and serve["tokens_per_s"] > 0
    transfer = stages["transfer"]
    assert transfer["host"]["gbps"] > 0 and transfer["host"]["correct"]
    assert transfer["nccl"] == {"skipped": "the NCCL path needs a GPU"}
