"""``python -m helpers measure|estimate|plan|fit|summary|...``: the course from a shell."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from helpers.names import (
    ACTIVATION_SETTINGS,
    ATTENTION,
    BF16_UPDATES,
    CHECKPOINT_POLICIES,
    OPTIMIZERS,
    PRECISIONS,
    STATE_DTYPES,
    WEIGHT_DTYPES,
    GiB,
    MiB,
    dora_problem,
    weights_problem,
)
from helpers.results import default_store, load, save, summary_table

# The other helpers modules (most import torch) are imported inside the command that needs
# them, so python -m helpers answers --help or a typo at once (tests/test_layers.py).

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input in one line on stderr, exit code 2."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


# RunConfig's fields that ``measure`` and ``estimate`` leave at their defaults: _run_config
# sets every other one from its option (tests/test_cli.py keeps the two lists covering it).
NOT_CLI_OPTIONS = ("data", "budget", "seed", "label")


def _run_config(args):
    """The RunConfig ``measure`` and ``estimate`` share, from ``_run_arguments``' options."""
    from helpers.train import RunConfig

    return RunConfig(
        model=args.model,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        precision=args.precision,
        optimizer=args.optimizer,
        weight_dtype=args.weight_dtype,
        state_dtype=args.state_dtype,
        bf16_update=args.bf16_update,
        gradient_checkpointing=args.gradient_checkpointing,
        checkpoint_policy=args.checkpoint_policy,
        offload_activations=args.offload_activations,
        optimizer_in_backward=args.optimizer_in_backward,
        loss_chunk=args.loss_chunk,
        grad_accum=args.grad_accum,
        lora_r=args.lora_r,
        lora_targets=args.lora_targets,
        qlora=args.qlora,
        dora=args.dora,
        attn=args.attn,
        device=args.device,
        warmup=args.warmup,
        repeats=args.repeats,
        flops=not args.no_flops,
    )


def _measure(args) -> int:
    from helpers.train import measure

    cfg = _run_config(args)
    try:  # the run checks itself (RunConfig.problem, model_config): one message, no traceback
        record = measure(cfg)
    except ValueError as err:  # a bad setting, a config it cannot read, a precision it lacks
        return _fail(str(err))
    except RuntimeError as err:  # an optional package missing: the message says which
        if "pip install" in str(err):
            return _fail(str(err))
        raise
    if args.save:
        save(record, lesson="cli")
    mem = record.memory
    fields = ("params", "gradients", "optimizer_state", "activations", "temporaries", "peak")
    summary = {"n_params": record.n_params, **{k: int(mem[k]) for k in fields}}
    summary.update(
        step_time_s=record.step_time,
        samples_per_s=record.samples_per_s,
        device=record.device["name"],
        allocator_peak_allocated=(record.allocator or {}).get("allocated"),
        allocator_peak_reserved=(record.allocator or {}).get("reserved"),
        nvml_used=record.nvml_used,
        mfu=record.mfu,
    )
    _print_summary(summary, args.json)
    return 0


def _print_summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary))
        return
    for key, value in summary.items():
        if isinstance(value, int) and key != "n_params":
            value = f"{value:,} B ({value / MiB:.1f} MiB)"
        print(f"{key:>26}: {value}")


# What ``estimate`` prints, in order; CATEGORIES_HELP explains each one.
ESTIMATE_FIELDS = ("params", "gradients", "optimizer_state", "activations", "temporaries",
                   "weight_copies", "buffers", "peak")  # fmt: skip
CATEGORIES_HELP = """\
What the byte counts mean (one steady-state training step, each category at its own largest):
  params           the weights as stored: 4 B each in fp32, 2 in bf16 or fp16 (--weight-dtype)
  gradients        one per trained weight, in its dtype (LoRA: the adapters' only)
  optimizer_state  AdamW: two moments per trained weight in its dtype (8 B in fp32, 4 in bf16)
                   and a 4-byte step per tensor; Kahan's AdamW 2 B more; 8-bit AdamW about 2
  activations      what the forward pass keeps for the backward; grows with batch x sequence
  temporaries      short-lived tensors: the 16-bit weight copies, attention scores being
                   formed, the loss's copies of the logits, the optimizer step's scratch
  weight_copies    autocast's 16-bit copies of fp32 weights (part of temporaries; none when
                   the weights already are 16-bit)
  buffers          tensors the model keeps but does not train (rotary tables, position ids)
  peak             the most bytes alive at one moment: less than the sum, as the categories
                   peak at different moments (peak_at says when)
Sizes: GB, MB are powers of ten (16GB = 16 x 10^9 bytes), GiB, MiB powers of two."""


def _estimate(args) -> int:
    from helpers.estimator import estimate_run

    cfg = _run_config(args)
    problem = cfg.problem()  # the run's own checks (RunConfig.problem), before any config read
    if problem:
        return _fail(problem)
    try:
        est = estimate_run(cfg)
    except (OSError, ValueError, KeyError) as err:  # unreadable config, unknown family, limits
        return _fail(f"cannot estimate {args.model!r}: {type(err).__name__}: {err}")
    summary = {"n_params": est.n_params, **{k: int(getattr(est, k)) for k in ESTIMATE_FIELDS}}
    summary["peak_at"] = est.peak_at
    summary["path"] = est.path  # "analytical" (the stage model) or "traced" (fake tensors)
    summary["attn"] = args.attn  # sdpa unless asked: transformers' default for your model
    _print_summary(summary, args.json)
    return 0


def _plan(args) -> int:
    from helpers.planner import bytes_read_as, parse_bytes, plan

    if (args.budget is None) == (args.card is None):
        return _fail(
            "give --budget SIZE (plan and time candidates on this machine) or --card NAME|SIZE "
            "(plan for a card on paper), one of the two"
        )
    if args.effective_batch < 1 or (args.seq_len is not None and args.seq_len < 1):
        return _fail("--effective-batch and --seq-len must be positive")
    if args.top_k < 1 or args.rounds < 5:
        return _fail("--top-k must be positive and --rounds at least 5")
    space, problem = _plan_space(args)
    if problem:
        return _fail(problem)
    if args.card is not None:
        return _plan_card(args, space)
    try:
        budget = parse_bytes(args.budget)
    except ValueError as err:
        return _fail(f"--budget: {err}")
    try:
        result = plan(args.model, budget, args.effective_batch, args.seq_len, device=args.device,
                      top_k=args.top_k, rounds=args.rounds, **space)  # fmt: skip
    except (OSError, ValueError, KeyError) as err:
        return _fail(f"cannot plan for {args.model!r}: {err}")
    if args.json:
        print(json.dumps(_plan_summary(result)))
    else:
        print(f"budget: {bytes_read_as(args.budget)}")
        _print_plan(result)
    return 0 if result.best else 1


def _plan_space(args) -> tuple[dict, str | None]:
    """``plan``'s search space from its options (``helpers.planner.candidates``' keywords),
    or the one-line reason it is not a search."""
    from helpers.planner import BF16_FULL_UPDATE

    def listed(text: str | None, known, what: str):
        names = tuple(x.strip() for x in text.split(",") if x.strip()) if text else ()
        unknown = [x for x in names if x not in known]
        return names, (
            f"unknown {what} {unknown[0]!r}: use {', '.join(known)}" if unknown else None
        )

    if args.lora_r < 0 or (args.qlora and not args.lora_r):
        return {}, "--lora-r must be positive for LoRA (and --qlora trains LoRA: give --lora-r)"
    precisions, bad_p = listed(args.precision, PRECISIONS, "precision")
    optimizers, bad_o = listed(args.optimizer, OPTIMIZERS, "optimizer")
    attentions, bad_a = listed(args.attn, ATTENTION, "attention")
    kept, bad_k = listed(args.activations, ACTIVATION_SETTINGS, "activation setting")
    problem = bad_p or bad_o or bad_a or bad_k or dora_problem(args.dora, args.lora_r, args.qlora)
    space = {"lora_r": args.lora_r, "lora_targets": args.lora_targets, "qlora": args.qlora,
             "dora": args.dora}  # fmt: skip
    if kept:
        space["checkpointing"] = kept
    if attentions:
        space["attentions"] = attentions
    if precisions:
        space["precisions"] = precisions
    if optimizers:
        space["optimizers"] = optimizers
    if args.weight_dtype:
        full_bf16 = args.weight_dtype == "bf16" and not args.lora_r
        update = args.bf16_update or (BF16_FULL_UPDATE if full_bf16 else "nearest")
        space["weights"] = [(args.weight_dtype, update)]
        # checked in the compute it needs (16-bit weights compute in their own dtype)
        problem = problem or weights_problem(args.weight_dtype, "", update, args.weight_dtype,
                                             "adamw", args.lora_r)  # fmt: skip
    return space, problem


def _card(text: str):
    """A reference card by name (t4, l4, a100-40, h100...) or one of a size ("24GB", "80GiB",
    compute capability 8.0 assumed); ValueError naming what it takes."""
    from helpers.device import GpuInfo
    from helpers.hardware import REFERENCE_CARDS
    from helpers.planner import parse_bytes

    name = text.strip().lower()
    if name in REFERENCE_CARDS:
        return REFERENCE_CARDS[name]
    try:
        size = parse_bytes(text)
    except ValueError:
        raise ValueError(
            f"--card {text!r}: name one of {', '.join(REFERENCE_CARDS)}, or give a size such as "
            "24GB or 80GiB"
        ) from None
    return GpuInfo(f"{text.strip()} card (compute capability 8.0 assumed)", size, (8, 0), 0, "")


def _plan_card(args, space: dict) -> int:
    """``plan --card``: ``helpers.planner.plan_for_card`` on paper, its answer and why."""
    from helpers.planner import bytes_read_as, plan_for_card

    try:
        card = _card(args.card)
    except ValueError as err:
        return _fail(str(err))
    if args.seq_len is None:
        return _fail("--seq-len is needed with --card: the sequence length you will train at")
    space.setdefault("attentions", ("sdpa",))  # transformers' default for a model of yours
    method = "qlora" if space.pop("qlora") else "lora" if space["lora_r"] else "full"
    lora = {
        "lora_r": space.pop("lora_r"),
        "lora_targets": space.pop("lora_targets") or "all-linear",
        "dora": space.pop("dora"),
    }
    try:
        result = plan_for_card(args.model, card, args.effective_batch, args.seq_len, method,
                               report=lambda done, total: None, **lora, **space)  # fmt: skip
    except (OSError, ValueError, KeyError) as err:
        return _fail(f"cannot plan for {args.model!r}: {err}")
    best = result.best
    summary = {
        "card": result.card, "method": result.method, "budget": result.budget,
        "usable": result.usable, "attentions": list(space["attentions"]),
        "best": best.label if best else None,
        "best_estimated_peak": best.estimated_peak if best else None,
        "considered": result.considered, "searched": result.searched,
        "fitting": len(result.fitting), "smallest_peak": result.smallest_peak,
        "reason": result.reason,
    }  # fmt: skip
    if args.json:
        print(json.dumps(summary))
        return 0 if best else 1
    if card.name.endswith("card (compute capability 8.0 assumed)"):
        print(f"card: {bytes_read_as(args.card)}")
    print(f"plan for {result.model} on the {result.card}, on paper (nothing runs): "
          f"{result.usable / GiB:.1f} GiB usable of {result.budget / GiB:.1f} GiB")  # fmt: skip
    print(f"attention assumed: {', '.join(space['attentions'])} (--attn to change; "
          "transformers' default is sdpa)")  # fmt: skip
    print(f"{result.considered} of {result.searched} configurations estimated (cheapest "
          "predicted first, up to the first that fits; none that holds more than a twin "
          f"estimated at no lower cost), {len(result.fitting)} fit")  # fmt: skip
    if best is not None:
        est = best.estimate
        print(f"best: {best.label}, estimated peak {best.estimated_peak / GiB:.2f} GiB")
        for key in ESTIMATE_FIELDS[:-1]:
            print(f"{key:>26}: {getattr(est, key) / GiB:.2f} GiB")
    print(result.reason)
    return 0 if best else 1


def _plan_summary(result) -> dict:
    """The plan's outcome as the JSON object ``plan --json`` prints."""
    best, runner = result.best, result.runner_up
    return {
        "best": best.candidate.label if best else None,
        "best_samples_per_s": best.samples_per_s if best else None,
        "best_estimated_peak": best.candidate.estimated_peak if best else None,
        "best_measured_peak": best.measured_peak if best else None,
        "runner_up": runner.candidate.label if runner else None,
        "runner_up_samples_per_s": runner.samples_per_s if runner else None,
        "budget": result.budget,
        "considered": result.considered,
        "fitting": len(result.fitting),
        "measured": len(result.measured),
        "reason": result.reason,
    }


def _print_plan(result) -> None:
    """The plan as a learner reads it: what was searched, measured and chosen, and why."""
    print(
        f"plan for {result.model}: budget {result.budget:,} B, effective batch "
        f"{result.effective_batch}, sequence length {result.seq_len}, on {result.device}"
    )
    print(
        f"{result.considered} configurations estimated, {len(result.fitting)} fit; "
        f"measured the {len(result.measured)} cheapest:"
    )
    for m in result.measured:
        c = m.candidate
        speed = f"{m.samples_per_s:8.3g} samples/s" if m.ok else f"failed: {m.error}"
        print(f"  {c.label:<48} est. peak {c.estimated_peak / MiB:9.1f} MiB  {speed}")
    if result.best:
        print(f"best:      {result.best.candidate.label}")
    if result.runner_up:
        print(f"runner-up: {result.runner_up.candidate.label}")
    print(result.reason)


def _summary(args) -> int:
    import pandas as pd  # slow: only the tables need it

    path = args.results or default_store()
    records = load(path)
    if not records:
        print(f"no experiments recorded in {path} yet: run the notebooks first")
        return 0
    with pd.option_context("display.max_rows", None, "display.width", 200):
        print(f"{len(records)} records in {path}")
        print(summary_table(records).to_string(index=False))
    return 0


def _capstone(args) -> int:
    import pandas as pd  # slow: only the tables need it

    from helpers.lessons.putting_it_together import (
        SEED_DEVICE,
        ablation_table,
        device_memory,
        latest_records,
    )

    path = args.results or default_store()
    records = latest_records(load(path))
    if not records:
        print(f"no ablation recorded in {path} yet: run notebooks/14_putting_it_together.ipynb")
        return 0
    table = ablation_table(records)
    any_rec = next(iter(records.values()))
    view = device_memory(records["vanilla"])[1] if "vanilla" in records else "?"
    with pd.option_context("display.width", 200, "display.max_columns", None):
        print(
            f"Lesson 14's ablation on {any_rec.device.get('name', '?')} "
            f"({any_rec.config.get('model')}, seq {any_rec.config.get('seq_len')}; memory: "
            f"{view}) against {SEED_DEVICE}, each as a ratio to its own vanilla run:"
        )
        print(table.round(2).to_string())
    return 0


def _cheatsheet(args) -> int:
    from helpers.course.cheatsheet import markdown, measured_on

    path = args.results or default_store()
    records = load(path)
    print(f"Measured on {measured_on(records)} ({path}); each ratio is variant / baseline:")
    print(markdown(records))
    return 0


def _hardware(args) -> int:
    from helpers.hardware import hardware_report

    print(json.dumps(hardware_report().as_dict(), indent=2, default=str))
    return 0


def _claims(args) -> int:
    """How the speed claims came out (helpers.timing.claims_summary); 1 on a confirmed wrong one."""
    from helpers.timing import CLAIMS_ENV, claims_summary, read_claims

    path = args.claims or os.environ.get(CLAIMS_ENV)
    if not path or not os.path.exists(path):
        print(f"no speed claims recorded ({path or f'${CLAIMS_ENV} is not set'})")
        return 0
    rows = read_claims(path)
    print(claims_summary(rows))
    return 1 if any(r["verdict"] == "fails" for r in rows) else 0


def _preflight(args) -> int:
    """Each feature the lessons need, tried in a fresh process; the table; exit 1 if one fails."""
    from helpers.course.preflight import format_result, run_preflight
    from helpers.isolate import start

    start()
    result = run_preflight(args.device)
    print(format_result(result))
    return 1 if result.failed else 0


def _fit(args) -> int:
    """The full scale fitted to this machine's GPU, per lesson; or the reference cards' table."""
    from helpers.course.fullscale import fit_markdown, fit_table
    from helpers.device import default_device, gpu_info, is_cuda
    from helpers.scale import fit_scale

    device = default_device()
    if args.reference or not is_cuda(device):
        if not args.reference:
            print(f"no CUDA GPU here ({device}); the full scale on the course's reference cards:\n")
        print(fit_markdown(), end="")
        return 0
    card = gpu_info(device)
    scale = fit_scale(card)
    print(scale.describe(device))
    if scale.name != "full":
        return 0
    for row in fit_table(scale, card):
        detail = "; ".join(filter(None, [row.why, *row.skips]))
        print(f"{row.lesson}  {row.status:<12} up to {row.need / GiB:5.1f} GiB  {detail}")
    return 0


def _doctor(args) -> int:
    """Each package the course uses: its version against the tested range, what a missing
    optional one costs (helpers.compat). Exit 1 when a required package is missing or older
    than the oldest version tested."""
    from helpers.compat import package_report

    report = package_report()
    for status in report:
        print(status.line())
    problems = [s.package.distribution for s in report if s.problem]
    if problems:
        print(f"required packages missing or too old: {' '.join(problems)}; install them, e.g. "
              f"pip install {' '.join(problems)}")  # fmt: skip
        return 1
    print("every required package imports, within the tested range or newer")
    return 0


def _gpu_check(args) -> int:
    """Parts a-d of helpers.course.gpu_check within the deadline; 1 if something failed."""
    from helpers.course.gpu_check import GpuCheckConfig, reports_markdown, run_gpu_check

    if args.summary:
        print(reports_markdown(), end="")
        return 0
    if args.deadline <= 0:
        return _fail("--deadline must be positive (minutes)")
    lessons = tuple(args.lessons.split(",")) if args.lessons else None
    cfg = GpuCheckConfig(args.deadline, Path(args.out) if args.out else None, args.quick,
                         lessons, args.device)  # fmt: skip
    try:
        result, path = run_gpu_check(cfg, say=lambda text: print(text, flush=True))
    except ValueError as err:  # an unknown lesson, a device that is not here
        return _fail(str(err))
    print(f"report: {path} (and {path.with_suffix('.json').name})")
    for problem in result.problems:
        print(f"problem: {problem}")
    return 1 if result.problems else 0


def _gpu_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--deadline", type=float, default=9.0, help="minutes (default 9)")
    p.add_argument("--out", default=None, help="report folder (default: reports/gpu on a GPU)")
    p.add_argument("--quick", action="store_true", help="make test's short version")
    p.add_argument("--lessons", default="", help='notebooks, e.g. "00,09" (default: all)')
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: the accelerator)")
    p.add_argument("--summary", action="store_true", help="README's table of the GPU reports")


def _run_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments ``measure`` and ``estimate`` share (``_run_config`` reads them)."""
    p.add_argument("--model", required=True, help="config JSON path, bundled name, or hub id")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS))
    p.add_argument("--optimizer", default="adamw", help=" | ".join(OPTIMIZERS))
    p.add_argument(
        "--weight-dtype",
        default="fp32",
        help=f"{' | '.join(WEIGHT_DTYPES)}: how weights and their gradients are stored; bf16 "
        "keeps no fp32 master copy (with --precision bf16)",
    )
    p.add_argument(
        "--state-dtype",
        default="",
        help=f"{' | '.join(STATE_DTYPES)}: the optimizer state's dtype (default: that of the "
        "weights it trains)",
    )
    p.add_argument(
        "--bf16-update",
        default="nearest",
        help=f"{' | '.join(BF16_UPDATES)}: how AdamW updates bf16 weights (stochastic: "
        "torchao's rounding; kahan: torch-optimi's compensated sum)",
    )
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--checkpoint-policy", default="full", help=f"{' | '.join(CHECKPOINT_POLICIES)}"
                   ": what checkpointed layers keep (selective: also what matmuls and attention "
                   "return; lesson 16)")  # fmt: skip
    p.add_argument("--offload-activations", action="store_true", help="tensors saved for "
                   "backward go to host memory (save_on_cpu; lesson 16)")  # fmt: skip
    p.add_argument("--optimizer-in-backward", action="store_true", help="each parameter steps "
                   "as soon as its gradient exists (lesson 16)")  # fmt: skip
    p.add_argument("--loss-chunk", type=int, default=0, help="causal LM: tokens of logits per "
                   "chunk of the loss; 0: all at once (lesson 16)")  # fmt: skip
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank (peft); 0: train all")
    p.add_argument("--lora-targets", default="", help='LoRA modules: "q_proj,v_proj", "all-linear"')
    p.add_argument("--qlora", action="store_true", help="LoRA on 4-bit frozen Linear weights (NF4)")
    p.add_argument("--dora", action="store_true", help="DoRA: LoRA with a trained magnitude per "
                   "output row (peft use_dora)")  # fmt: skip
    p.add_argument("--attn", default="sdpa", choices=list(ATTENTION),
                   help="sdpa: transformers' default; eager: the attention matrices")  # fmt: skip
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: the accelerator)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-flops", action="store_true", help="skip the FLOP count (and MFU)")
    p.add_argument("--save", action="store_true", help="append the record to the results store")
    p.add_argument("--json", action="store_true", help="last stdout line is one JSON object")


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``plan``."""
    p.add_argument("--model", required=True, help="config JSON path, bundled name, or hub id")
    p.add_argument("--budget", default=None, help="plan here and time candidates within it: "
                   "16GiB (2^30 bytes each), 16GB (10^9), 512MiB")  # fmt: skip
    p.add_argument("--card", default=None, help="plan on paper for a card that need not be "
                   "here: t4, v100, a10g, l4, a100-40, a100-80, h100, a100-mig, or a size "
                   "(24GB)")  # fmt: skip
    p.add_argument("--effective-batch", type=int, required=True, help="samples per step")
    p.add_argument("--seq-len", type=int, default=None, help="default: the scale's length")
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank (peft); 0: full fine-tuning")
    p.add_argument("--lora-targets", default="", help='LoRA modules (--card: "all-linear")')
    p.add_argument("--qlora", action="store_true", help="LoRA on 4-bit frozen weights (NF4)")
    p.add_argument("--dora", action="store_true", help="DoRA adapters (with --lora-r)")
    p.add_argument("--weight-dtype", default=None, help=f"{' | '.join(WEIGHT_DTYPES)}: only this "
                   "(default: fp32 and, where bf16 is searched, bf16 weights)")  # fmt: skip
    p.add_argument("--bf16-update", default=None, help=f"{' | '.join(BF16_UPDATES)} (default: "
                   "kahan for full fine-tuning in bf16)")  # fmt: skip
    p.add_argument("--precision", default=None, help="comma list, e.g. bf16 (default: all the "
                   "device or card runs)")  # fmt: skip
    p.add_argument(
        "--optimizer", default=None, help="comma list (default adamw,adamw8bit,adafactor)"
    )
    p.add_argument("--attn", default=None, help="comma list (default: sdpa with --card, both here)")
    kept = ", ".join(ACTIVATION_SETTINGS)
    p.add_argument("--activations", default=None, help=f"comma list of {kept}: what the step "
                   "keeps for backward (default: all; offload with a GPU or --card)")  # fmt: skip
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: the accelerator)")
    p.add_argument("--top-k", type=int, default=6, help="how many candidates to time")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (at least 5)")
    p.add_argument("--json", action="store_true", help="last stdout line is one JSON object")


def _results_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", default=None, help="results store (default: $COURSE_RESULTS)")


def _claims_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--claims", default=None, help="claims log (default: $COURSE_CLAIMS)")


def _fit_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reference", action="store_true", help="the table for the reference cards")


def _device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: the accelerator)")


# Each command: what runs it, its arguments (None: none), and its help line.
COMMANDS = {
    "measure": (_measure, _run_arguments, "train a few steps here, report bytes per category"),
    # estimate takes measure's arguments; --warmup/--repeats/--save are unused there
    "estimate": (_estimate, _run_arguments, "predict measure's bytes without weights"),
    "plan": (_plan, _plan_arguments, "fastest configuration that fits a memory budget"),
    "summary": (_summary, _results_argument, "print the table of recorded experiments"),
    "capstone": (_capstone, _results_argument, "lesson 14's ablation next to the guide's V100 run"),
    "cheatsheet": (_cheatsheet, _results_argument, "the guide's methods with the ratios measured"),
    "fit": (_fit, _fit_argument, "what the full scale runs on this GPU, lesson by lesson"),
    "claims": (_claims, _claims_argument, "how the lessons' speed claims came out"),
    "preflight": (_preflight, _device_argument, "try every hardware feature the lessons use"),
    "hardware": (_hardware, None, "print the hardware report"),
    "doctor": (_doctor, None, "the course's packages against the tested versions"),
    "gpu-check": (_gpu_check, _gpu_check_arguments, "prove the course on this machine (a GPU)"),
}


def parser() -> argparse.ArgumentParser:
    """The parser of ``python -m helpers``, every command's arguments included."""
    top = _Parser(prog="python -m helpers", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (run, arguments, help_line) in COMMANDS.items():
        epilog = CATEGORIES_HELP if name in ("measure", "estimate", "plan") else None
        command = sub.add_parser(name, help=help_line, description=help_line, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        if arguments is not None:
            arguments(command)
        command.set_defaults(func=run)
    return top


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m helpers``."""
    args = parser().parse_args(argv)
    return args.func(args)
