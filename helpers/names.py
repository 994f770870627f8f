"""The course's names and units, defined once: every module and notebook imports them from here."""

OPTIMIZERS = ("adamw", "sgd", "adafactor", "adamw8bit")  # RunConfig.optimizer (lesson 06)
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")  # RunConfig.precision (lesson 05)
AUTOCAST = ("bf16", "fp16")  # the precisions that run the step under torch.autocast
PRECISION_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}  # bytes per activation value
ATTENTION = ("eager", "sdpa")  # attention kinds the estimator models and the planner searches
# RunConfig.attn: also flash_attention_2 (lesson 10; a GPU of compute capability 8.0+ and the
# flash-attn package), which the estimator does not model.
TRAIN_ATTENTION = (*ATTENTION, "flash_attention_2")

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40  # binary units: what allocators count in


def human_bytes(nbytes: float) -> str:
    """``64 MiB``, ``16 GiB``, ``1.5 KiB``: the largest binary unit the size reaches, 3 digits."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{int(nbytes)} B"
