"""Two ways to take bytes off a step's peak without changing what it computes (lesson 16).

- ``OptimizerInBackward``: each parameter steps as soon as its gradient is complete, inside
  backward, and the gradient is freed at once (PyTorch's recipe "How to save memory by fusing
  the optimizer step into the backward pass"). The step never holds every gradient at once.
- ``ChunkedCausalLMLoss``: a causal LM's loss computed over chunks of tokens, each chunk's
  logits made, used and freed inside a checkpoint, so the step never holds the full
  tokens x vocabulary logits and their log-softmax (the largest tensors of a step with a large
  vocabulary).

And two settings of what autograd keeps for backward (``RunConfig.checkpoint_policy`` and
``offload_activations``): ``save_matmuls``, the selective checkpointing policy (keep what
matrix multiplications and attention kernels return, recompute the cheap element-wise rest),
and ``offloaded``, a loss whose forward saves its tensors for backward in host memory
(``torch.autograd.graph.save_on_cpu``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

_aten = torch.ops.aten
_ATTENTION_KERNELS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
# What the selective policy keeps: the outputs of matrix multiplications (a Linear layer is an
# mm or addmm, eager attention's two products are bmm) and of SDPA's kernels, one per backend.
SAVED_OPS = frozenset(
    [_aten.mm.default, _aten.addmm.default, _aten.bmm.default]
    + [getattr(_aten, name).default for name in _ATTENTION_KERNELS if hasattr(_aten, name)]
)


def save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: keep what matmuls and attention kernels return, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn() -> Callable:
    """The ``context_fn`` that makes ``torch.utils.checkpoint`` selective with ``save_matmuls``."""
    return functools.partial(create_selective_checkpoint_contexts, save_matmuls)


def offloaded(loss_of: Callable, device: torch.device) -> Callable:
    """``loss_of`` with its forward under ``save_on_cpu``: every tensor saved for backward is
    copied to host memory (pinned on CUDA) and back when backward needs it. On the CPU the
    host is the device: nothing moves (``.cpu()`` of a CPU tensor is the tensor)."""

    def offloaded_loss_of(model, batch):
        pin = device.type == "cuda"
        with torch.autograd.graph.save_on_cpu(pin_memory=pin, device_type=device.type):
            return loss_of(model, batch)

    return offloaded_loss_of


IGNORE = -100  # the label transformers' losses skip (padding, and the token after the last)


class OptimizerGroup:
    """Several optimizers standing where one ``torch.optim.Optimizer`` stands: ``optimizers``
    (a dict of them) gives ``state`` and ``param_groups`` together, which the tracker and
    GradScaler read (``OptimizerInBackward``, ``helpers.train.MuonWithAdamW``)."""

    optimizers: dict

    @property
    def state(self) -> dict:
        """Every parameter's optimizer state (as ``Optimizer.state``)."""
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    @property
    def param_groups(self) -> list[dict]:
        """Every optimizer's parameter groups."""
        return [g for opt in self.optimizers.values() for g in opt.param_groups]


class OptimizerInBackward(OptimizerGroup):
    """One optimizer per parameter, stepped from the parameter's post-accumulate-grad hook.

    ``make(params)`` builds the optimizer for a one-parameter list (``helpers.train``'s
    ``make_optimizer`` by name). It stands where a ``torch.optim.Optimizer`` stands in a loop:
    ``step()`` and ``zero_grad()`` do nothing, because the work happened in backward, and
    ``state``/``param_groups`` gather the per-parameter optimizers' own.

    What it costs: a parameter's gradient lives only until its own step, so nothing can look at
    all the gradients together, no gradient accumulation over micro-batches (each backward
    would step), and no clipping by the global norm (clipping one tensor at a time is possible).

    It is the course's measuring harness, not a class to train with: it is no
    ``torch.optim.Optimizer``, so no learning-rate scheduler can drive it, and it has no
    ``state_dict``/``load_state_dict`` for checkpoints. ``recipes/optimizer_in_backward.py``
    has both: one scheduler per parameter's optimizer, and a checkpoint keyed by parameter name
    (the layout of torchtune's ``OptimizerInBackwardWrapper``).
    """

    def __init__(self, params, make: Callable[[list], torch.optim.Optimizer]) -> None:
        self.optimizers = {p: make([p]) for p in params if p.requires_grad}
        self._handles = [p.register_post_accumulate_grad_hook(self._step_one)
                         for p in self.optimizers]  # fmt: skip

    def _step_one(self, param: torch.Tensor) -> None:
        """Step ``param`` with its own optimizer and free its gradient."""
        optimizer = self.optimizers[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Nothing: every parameter already stepped inside backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: each gradient was freed right after its own step."""

    def remove(self) -> None:
        """Take the hooks off the parameters (the model then trains with a normal optimizer)."""
        for handle in self._handles:
            handle.remove()


def causal_targets(labels: torch.Tensor) -> torch.Tensor:
    """Each position's next-token label, flattened; the last position of a row is ignored.

    The same shift transformers' causal-LM loss makes: pad the labels with one ignored label
    and drop the first, so position i predicts label i + 1.
    """
    return F.pad(labels, (0, 1), value=IGNORE)[:, 1:].reshape(-1)


def _chunk_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one chunk: its logits exist only inside this function."""
    logits = head(hidden).float()  # upcast, as transformers' loss does under autocast
    return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")


class ChunkedCausalLMLoss(torch.nn.Module):
    """A causal LM's mean next-token loss, ``chunk_tokens`` tokens of logits at a time.

    ``loss = ChunkedCausalLMLoss(model, 1024)(batch)``. The model's body gives the final hidden
    states; the output embedding (``lm_head``) and the cross-entropy run chunk by chunk inside
    non-reentrant checkpoints, which keep only each chunk's input and recompute its logits in
    backward. Equal to ``model(**batch).loss`` up to the order of float additions. It is a
    module so that the whole loss is one forward of one module, as ``model(**batch)`` is (the
    memory tracker reads a top-level forward as the start of a micro-batch).
    """

    def __init__(self, model: torch.nn.Module, chunk_tokens: int) -> None:
        super().__init__()
        if model.get_output_embeddings() is None:
            raise ValueError("chunked loss needs a causal LM with an output embedding (lm_head)")
        self.model, self.chunk_tokens = model, chunk_tokens

    def forward(self, batch: dict) -> torch.Tensor:
        """The loss of ``batch`` (input_ids, attention_mask, labels)."""
        head = self.model.get_output_embeddings()
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        hidden = self.model.get_decoder()(**inputs).last_hidden_state
        flat = hidden.reshape(-1, hidden.shape[-1])
        targets = causal_targets(batch["labels"])
        total = flat.new_zeros((), dtype=torch.float32)
        for start in range(0, flat.shape[0], self.chunk_tokens):
            end = start + self.chunk_tokens
            total = total + checkpoint(
                _chunk_loss, head, flat[start:end], targets[start:end], use_reentrant=False
            )
        return total / (targets != IGNORE).sum()
