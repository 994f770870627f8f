"""What ``gpu-check`` would plan on a card, from a committed report of that card, before any
device time is spent.

    python tools/gpu_plan_offline.py reports/gpu/2026-11-28-nvidia-h200.json [--deadline 9]

The report gives the card (its memory, compute capability, multiprocessors), the host's cores,
the preflight's measured throughput and, where it has them, each setting's, recipe's and
lesson's seconds and part a's. The card is a fake one here (tests/fake_gpu.py, as in CI), so
the settings, recipes and lessons are those ``gpu-check`` would choose on it, with this
machine's optional packages; the plan is ``helpers.course.gpu_plan``'s, as the run makes it
after part a.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.course import gpu_check as G  # noqa: E402
from helpers.course.gpu_plan import plan_parts  # noqa: E402
from helpers.course.preflight import lesson_minutes  # noqa: E402
from helpers.device import GpuInfo  # noqa: E402
from helpers.scale import fit_scale  # noqa: E402
from tests.fake_gpu import FakeGpu, Profile  # noqa: E402


def _facts(report: dict) -> SimpleNamespace:
    """The card, the host's cores and the measured throughput, as the report states them."""
    env = report["environment"]
    total = int(re.search(r"\(([\d,]+) B\)", env["memory"]).group(1).replace(",", ""))
    capability = tuple(int(x) for x in env["compute capability"].split("."))
    sms = int(env["multiprocessors"])
    cores = int(re.search(r"(\d+) logical cores", env["cpu"]).group(1))
    tflops = float(re.search(r"([\d.]+) TFLOP/s fp32", report["preflight"]).group(1))
    card = GpuInfo(report["card"], total, capability, sms, "")
    return SimpleNamespace(card=card, cores=cores, flops_per_s=tflops * 1e12, scale=env["scale"])


def plan_from_report(report: dict, deadline_min: float, part_a_min: float) -> list[str]:
    """The plan's lines for the report's card, with ``part_a_min`` spent before it is made."""
    f = _facts(report)
    profile = Profile("card", f.card.name, f.card.total_memory, f.card.capability,
                      f.card.multiprocessors, "00000000-1a2b-4c3d-8e9f-000000000001",
                      f.card.total_memory)  # fmt: skip
    minutes, device = lesson_minutes(fit_scale(f.card), f.card, f.flops_per_s)
    preflight = SimpleNamespace(lesson_minutes=minutes, lesson_device_minutes=device,
                                flops_per_s=f.flops_per_s)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        FakeGpu(mp, [profile])
        mp.setattr(G.os, "cpu_count", lambda: f.cores)
        mp.setattr(G, "earlier_report", lambda reports, card: report)
        result = G.GpuCheckResult("offline", "cuda:0", f.card.name, deadline_min,
                                  environment={"scale": f.scale},
                                  card_bytes=f.card.total_memory)  # fmt: skip
        run = G._Run(G.GpuCheckConfig(device="cuda:0"), result, G.Clock(deadline_min),
                     lambda: None, lambda line: None)  # fmt: skip
        run.shares = G.shares(G._slots(result))
        inputs = G._plan_inputs(run, preflight, G.estimator_settings("cuda:0"))
    plan = plan_parts(inputs, 60 * (deadline_min - part_a_min))
    total = part_a_min + plan.total() / 60
    return [f"a: {part_a_min:.1f} min", *plan.summary(),
            f"total with part a: {total:.1f} of {deadline_min:g} min"]  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a committed report's JSON")
    parser.add_argument("--deadline", type=float, default=9.0, help="minutes (default 9)")
    parser.add_argument("--part-a", type=float, default=None,
                        help="minutes of part a (default: the report's own)")  # fmt: skip
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    part_a = args.part_a
    if part_a is None:
        seconds = report.get("part_seconds", {}).get("a")
        if seconds is None:
            parser.error(f"{args.report} does not say how long part a took: give --part-a MIN")
        part_a = seconds / 60
    for line in plan_from_report(report, args.deadline, part_a):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
