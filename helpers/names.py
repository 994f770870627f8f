"""The course's names and units, defined once: every module and notebook imports them from here."""

# RunConfig.optimizer (lesson 06). lion and lion8bit are bitsandbytes' Lion (one moment);
# muon is torch.optim.Muon on the hidden layers' matrices with AdamW on every other tensor.
OPTIMIZERS = ("adamw", "sgd", "adafactor", "adamw8bit", "lion", "lion8bit", "muon")
BNB_OPTIMIZERS = ("adamw8bit", "lion", "lion8bit")  # need bitsandbytes; own state dtypes
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")  # RunConfig.precision (lesson 05)
AUTOCAST = ("bf16", "fp16")  # the precisions that run the step under torch.autocast
PRECISION_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}  # bytes per activation value
ATTENTION = ("eager", "sdpa")  # attention kinds the estimator models and the planner searches
# RunConfig.attn: also flash_attention_2 (lesson 10; a GPU of compute capability 8.0+ and the
# flash-attn package), which the estimator does not model.
TRAIN_ATTENTION = (*ATTENTION, "flash_attention_2")


# RunConfig.weight_dtype: how the weights, and so their gradients, are stored (lessons 01, 05).
# "fp32" is the guides' mixed precision: fp32 master weights under autocast. "bf16" keeps no
# fp32 copy at all, as from_pretrained(..., dtype=torch.bfloat16) and most fine-tuning today.
# "fp16": a frozen LoRA base in fp16 (cards without bf16, such as a T4); never trained in fp16.
WEIGHT_DTYPES = ("fp32", "bf16", "fp16")
# RunConfig.state_dtype: the optimizer state's dtype. torch's optimizers (and torchao's and
# torch-optimi's) make their state like the parameter they train, so "" means exactly that.
STATE_DTYPES = ("fp32", "bf16")
# RunConfig.bf16_update: how a bf16 weight takes its AdamW update (lesson 05). "nearest":
# plain rounding, which loses an update under half a weight's bf16 spacing; "stochastic":
# torchao's AdamW with bf16 stochastic rounding; "kahan": torch-optimi's AdamW with Kahan
# summation (one more bf16 buffer per weight that keeps what rounding lost).
BF16_UPDATES = ("nearest", "stochastic", "kahan")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def qlora_problem(qlora: bool, lora_r: int, precision: str, weight_dtype: str) -> str | None:
    """Why a QLoRA setting is not one (one sentence), or None: QLoRA trains LoRA adapters
    (a rank > 0) in 16-bit compute on 4-bit frozen Linear weights, the rest of the base
    16-bit already (so no other weight_dtype)."""
    if not qlora:
        return None
    if lora_r <= 0 or precision not in AUTOCAST:
        return (
            "QLoRA trains LoRA adapters (lora_r > 0) in 16-bit compute (precision bf16 or "
            "fp16) on 4-bit frozen weights"
        )
    if weight_dtype != "fp32":
        return (
            "QLoRA keeps its own weights (4-bit Linear layers, the rest 16-bit): leave "
            "weight_dtype unset"
        )
    return None


def dora_problem(dora: bool, lora_r: int, qlora: bool = False) -> str | None:
    """Why a DoRA setting is not one (one sentence), or None: DoRA is a LoRA variant (a rank
    > 0), and its magnitudes on a 4-bit base are not measured here."""
    if dora and lora_r <= 0:
        return "DoRA is a LoRA variant: give it a LoRA rank (lora_r > 0)"
    if dora and qlora:
        return "DoRA on a 4-bit QLoRA base is not measured here: use dora or qlora, not both"
    return None


# RunConfig.checkpoint_policy: what a checkpointed layer keeps for backward (lesson 16).
# "full": only the layer's input, the rest recomputed; "selective": also what matrix
# multiplications and attention kernels return (helpers.memory_savers.save_matmuls).
CHECKPOINT_POLICIES = ("full", "selective")


# The planner's and calculator's one axis for what a step keeps for backward (lesson 04 and
# 16): none, full or selective checkpointing, or every saved tensor offloaded to the host.
ACTIVATION_SETTINGS = ("none", "full", "selective", "offload")


def activation_fields(setting: str | bool) -> dict:
    """``RunConfig``'s fields for one of ``ACTIVATION_SETTINGS`` (True/False: full/none)."""
    setting = {True: "full", False: "none"}.get(setting, setting)
    if setting not in ACTIVATION_SETTINGS:
        raise ValueError(
            f"unknown activation setting {setting!r}: use {', '.join(ACTIVATION_SETTINGS)}"
        )
    return {
        "gradient_checkpointing": setting in ("full", "selective"),
        "checkpoint_policy": "selective" if setting == "selective" else "full",
        "offload_activations": setting == "offload",
    }


def activations_problem(gradient_checkpointing: bool, checkpoint_policy: str) -> str | None:
    """What is wrong with how a run keeps its activations (one sentence), or None. Offloading
    them combines with either policy: inside a checkpointed layer, checkpointing's own hooks
    decide what is saved, so only what the layers' outside saves goes to the host."""
    if checkpoint_policy not in CHECKPOINT_POLICIES:
        return (
            f"unknown checkpoint_policy {checkpoint_policy!r}: use one of "
            f"{', '.join(CHECKPOINT_POLICIES)}"
        )
    if checkpoint_policy != "full" and not gradient_checkpointing:
        return (
            f"checkpoint_policy {checkpoint_policy} chooses what checkpointed layers keep: "
            "turn gradient_checkpointing on (--gradient-checkpointing) or leave the policy full"
        )
    return None


def trained_dtype(weight_dtype: str, lora_r: int) -> str:
    """The dtype of the weights that get gradients and optimizer state: LoRA adapters stay
    fp32 on a bf16 base (peft's ``autocast_adapter_dtype``), every weight otherwise."""
    return "fp32" if lora_r else weight_dtype


def weights_problem(
    weight_dtype: str, state_dtype: str, bf16_update: str, precision: str, optimizer: str,
    lora_r: int = 0,
) -> str | None:  # fmt: skip
    """What is wrong with how a run stores its weights and optimizer state (one sentence), or
    None. The one home of these checks, asked by ``RunConfig.problem`` and the estimator."""
    if weight_dtype == "fp16" and not lora_r:
        return (
            "fp16 weights are a frozen LoRA base only: trained without an fp32 master copy, "
            "fp16's narrow range loses small gradients and updates; use weight_dtype bf16, or "
            "precision fp16 (autocast with loss scaling) over fp32 weights"
        )
    if weight_dtype not in WEIGHT_DTYPES:
        return f"unknown weight_dtype {weight_dtype!r}: use one of {', '.join(WEIGHT_DTYPES)}"
    if weight_dtype != "fp32" and precision != weight_dtype:
        return (
            f"{weight_dtype} weights compute in {weight_dtype}, not {precision}: use precision "
            f"{weight_dtype} (autocast over {weight_dtype} weights, as the Trainer's "
            f"{weight_dtype}=True does with a model loaded in {weight_dtype})"
        )
    if state_dtype and state_dtype not in STATE_DTYPES:
        return f"unknown state_dtype {state_dtype!r}: use one of {', '.join(STATE_DTYPES)}"
    if state_dtype and optimizer in BNB_OPTIMIZERS:
        return f"{optimizer} (bitsandbytes) keeps its own state dtypes: leave state_dtype unset"
    trained = trained_dtype(weight_dtype, lora_r)
    if state_dtype and state_dtype != trained:
        return (
            f"the optimizers here keep their state in the dtype of the weights they train "
            f"({trained} here), not {state_dtype}: leave state_dtype unset or change weight_dtype"
        )
    if bf16_update not in BF16_UPDATES:
        return f"unknown bf16_update {bf16_update!r}: use one of {', '.join(BF16_UPDATES)}"
    if bf16_update != "nearest":
        if trained != "bf16":
            return (
                f"bf16_update {bf16_update} repairs updates of bf16 weights: it needs "
                "weight_dtype bf16 and full fine-tuning (LoRA adapters train in fp32)"
            )
        if optimizer != "adamw":
            return (
                f"bf16_update {bf16_update} is an AdamW here (torchao's or torch-optimi's): "
                "use optimizer adamw"
            )
    return None


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
