"""Lesson 07's loop runs unchanged under ``accelerate launch``, here with 2 CPU processes.

``accelerate launch --cpu`` always starts a single process (multi-CPU training goes through
MPI, configured with ``accelerate config``). ``--multi_gpu`` starts the processes with
torchrun; the script's own ``--cpu`` (``Accelerator(cpu=True)``) then makes Accelerate set
up multi-CPU data parallelism over gloo: data-parallel training on a laptop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_script_runs_under_accelerate_launch_with_two_processes(tmp_path):
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "HF_HOME": str(tmp_path / "hf"),
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "bf16",
           "--dynamo_backend", "no", str(ROOT / "scripts" / "train_accelerate.py"),
           "--cpu", "--max-steps", "2"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["process_index"] for r in lines) == [0, 1]  # one JSON line per process
    for r in lines:
        assert r["num_processes"] == 2 and r["mixed_precision"] == "bf16"
        assert len(r["losses"]) == 2 and all(0 < loss < 10 for loss in r["losses"])
        assert r["device"].startswith("cpu")
        # Data parallelism replicates the training state: every process holds all weights.
        assert r["memory"]["params"] == 4 * r["n_params"]
