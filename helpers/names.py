"""The course's names and units, defined once: every module and notebook imports them from here."""

OPTIMIZERS = ("adamw", "sgd", "adafactor", "adamw8bit")  # RunConfig.optimizer (lesson 06)
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")  # RunConfig.precision (lesson 05)
AUTOCAST = ("bf16", "fp16")  # the precisions that run the step under torch.autocast
PRECISION_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}  # bytes per activation value
ATTENTION = ("eager", "sdpa")  # attention kinds the estimator models and the planner searches
# RunConfig.attn: also flash_attention_2 (lesson 10; a GPU of compute capability 8.0+ and the
# flash-attn package), which the estimator does not model.
TRAIN_ATTENTION = (*ATTENTION, "flash_attention_2")


def setting_problem(
    precision: str, optimizer: str, attn: str, batch_size: int, seq_len: int, grad_accum: int,
    attentions: tuple[str, ...] = TRAIN_ATTENTION,
) -> str | None:  # fmt: skip
    """What is wrong with a run's setting, by name and size alone (one sentence), or None.

    The one home of these checks: ``RunConfig.problem`` (what trains) asks with every attention
    a run can use, the estimator with the ones it models (``ATTENTION``).
    """
    if precision not in PRECISIONS:
        return f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}"
    if optimizer not in OPTIMIZERS:
        return f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}"
    if attn not in attentions:
        return f"unknown attention {attn!r}: use one of {', '.join(attentions)}"
    if batch_size < 1 or seq_len < 1 or grad_accum < 1:
        return "batch size, sequence length and accumulation must be positive"
    return None


def seq_len_problem(seq_len: int, limit: int | None, model: str = "the model") -> str | None:
    """Why ``seq_len`` is too long for a model of ``limit`` positions, or None."""
    if limit and seq_len > limit:
        return (
            f"sequence length {seq_len} exceeds max_position_embeddings ({limit}) of {model}: "
            "use a shorter one"
        )
    return None


KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40  # binary units: what allocators count in


def human_bytes(nbytes: float) -> str:
    """``64 MiB``, ``16 GiB``, ``1.5 KiB``: the largest binary unit the size reaches, 3 digits."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{int(nbytes)} B"
