"""Lesson 06, sections 4-6 (notebooks/06_optimizers.ipynb).

Optimizers: the timings and runs the lesson adds to the state rules.

Section 4 reads the state the Trainer's optimizers hold, section 5 times ``optimizer.step()``
of AdamW's implementations in turns, section 6 trains the learnable task with each optimizer.
The state rules themselves are core machinery: ``helpers.optimizer_state``.
"""

from __future__ import annotations

import torch

from helpers.optimizer_state import read_state


def adamw_step_times(cfg, variants: dict[str, dict], repeats: int = 20, claims=()) -> dict:
    """``optimizer.step()`` alone for torch AdamW built with each kwargs set, timed in turns.

    The model of ``cfg`` gets fixed random gradients once; every variant starts from the same
    weights, so the updated weights can be compared too (key ``max_diff``: the largest
    difference from the first variant after one step). The variants' optimizers then step in
    interleaved rounds (``helpers.timing.compare_calls``, at least ``repeats`` rounds, more
    while a claim is undecided): key ``comparison``. A variant that cannot be built on this
    device comes back as its error message instead of a time.
    """
    from helpers.device import resolve
    from helpers.models import build_model, load_config
    from helpers.timing import compare_calls

    device = resolve(cfg.device)
    model = build_model(load_config(cfg.model), device=device, seed=cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(cfg.seed)
    start = [p.detach().clone() for p in params]
    grads = [1e-3 * torch.randn(p.shape, generator=g).to(device) for p in params]
    steps, errors, max_diff, ref = {}, {}, {}, None
    for label, kwargs in variants.items():
        for p, p0, gr in zip(params, start, grads, strict=True):
            p.data.copy_(p0)
            p.grad = gr
        try:
            opt = torch.optim.AdamW(params, lr=1e-3, **kwargs)
            opt.step()  # creates the state, and is the step whose result is compared
        except (RuntimeError, ValueError) as err:
            errors[label] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            continue
        if ref is None:  # the first variant that runs is the reference
            ref = [p.detach().clone() for p in params]
        max_diff[label] = max(
            float((p.detach() - r).abs().max()) for p, r in zip(params, ref, strict=True)
        )
        steps[label] = opt.step
    ran = [c for c in claims if c.name in steps and c.versus in steps]
    comparison = compare_calls(steps, device, warmup=2, rounds=repeats,
                               max_rounds=max(repeats, 15), claims=ran)  # fmt: skip
    return {"comparison": comparison, "errors": errors, "max_diff": max_diff,
            "n_tensors": len(params), "n_params": sum(p.numel() for p in params)}  # fmt: skip


def markov_curves(runs: dict, steps: int) -> dict:
    """Loss curves on the learnable task for several ``(RunConfig, lr)`` pairs, in order.

    Each run builds its own model from its seed, so runs do not influence each other; they
    share one process only to pay the imports once.
    """
    from helpers.train import train_markov

    return {label: train_markov(cfg, steps, lr) for label, (cfg, lr) in runs.items()}


def trainer_states(model_name: str, optims: list[str], steps: int = 2, seed: int = 0) -> dict:
    """Train ``steps`` steps with each of the Trainer's ``optim=`` names; report what it built.

    Per name: the optimizer's class, its hyper-parameters, the modules registered with
    bitsandbytes' GlobalOptimManager for 32-bit state, and ``read_state`` of the optimizer.
    A name that fails (bitsandbytes missing, say) comes back as {"error": message}.
    """
    return {optim: _trainer_state(model_name, optim, steps, seed) for optim in optims}


def _trainer_state(model_name: str, optim: str, steps: int, seed: int) -> dict:
    """One ``trainer_states`` entry: build, train and inspect one Trainer."""
    import tempfile
    import warnings
    from pathlib import Path

    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from helpers.data import MarkovTask, markov_dataset
    from helpers.device import resolve
    from helpers.models import build_model, load_config, task_kind

    config = load_config(model_name)
    device = resolve(None)
    model = build_model(config, device=device, seed=seed)
    task = MarkovTask(n_states=min(64, config.vocab_size), seed=seed)
    data = markov_dataset(task, task_kind(config), 4 * steps, 32, seed=seed)
    try:
        args = TrainingArguments(
            output_dir=str(Path(tempfile.gettempdir()) / "course-trainer-06"),
            optim=optim, max_steps=steps,
            per_device_train_batch_size=4, learning_rate=1e-3, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True,
            use_cpu=device.type == "cpu", seed=seed,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(model=model, args=args, train_dataset=data)
            trainer.remove_callback(PrinterCallback)  # no log lines: we report what it built
            trainer.train()
    except (ImportError, ValueError, RuntimeError) as err:
        return {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"}
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)  # accelerate wraps it
    overrides = []
    if "bitsandbytes" in type(opt).__module__:
        import bitsandbytes as bnb

        manager = bnb.optim.GlobalOptimManager.get_instance()
        names = {id(m): n for n, m in model.named_modules()}
        overrides = [
            (names.get(id(m), "?"), attr, cfg)
            for m, attr, cfg in manager.module_weight_config_triple
        ]
    hyper = {k: v for k, v in opt.defaults.items() if isinstance(v, (int, float, bool, tuple))}
    if hasattr(opt, "args"):  # bitsandbytes keeps optim_bits and min_8bit_size here
        hyper.update({k: getattr(opt.args, k) for k in ("optim_bits", "min_8bit_size")})
    return {
        "class": f"{type(opt).__module__}.{type(opt).__name__}",
        "hyper": hyper,
        "overrides": overrides,
        "state": read_state(model, opt),
    }
