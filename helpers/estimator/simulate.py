"""The step, moment by moment: forward, backward and the optimizer step walked in order."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from helpers.estimator.stages import Moment, Stage


@dataclass
class Estimate:
    """Predicted bytes per category (the measure contract) and where the peak falls."""

    n_params: int
    params: int
    buffers: int
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int
    weight_copies: int
    peak: int
    peak_at: str  # "forward: ...", "backward: <stage>", "optimizer step"
    layer_activations: dict[str, int] = field(default_factory=dict)  # one layer, labelled
    paper_layer_bytes: int = 0  # Korthikanti et al.'s s·b·h·(34 + 5as/h) for one layer
    path: str = "analytical"  # "analytical" (the stage model) or "traced" (fake tensors)

    def as_dict(self) -> dict:
        """Plain dict for records and JSON."""
        return asdict(self)


@dataclass
class _Walk:
    """Running maxima of a walk through the step, and where the total peaked."""

    activations: int = 0
    temporaries: int = 0
    copies: int = 0
    peak: int = 0
    where: str = ""
    moments: list[PredictedMoment] | None = None  # every moment, when asked for (timeline)
    base: int = 0  # bytes of the model state under every moment (weights, buffers, state)

    def seen(self, total: int, label: str, grads: int = 0, acts: int = 0, temps: int = 0) -> None:
        """Note a moment's total bytes; the first moment of a new maximum names the peak."""
        if total > self.peak:
            self.peak, self.where = total, label
        if self.moments is not None:
            self.moments.append(PredictedMoment(label, self.base, grads, acts, temps, total))


@dataclass(frozen=True)
class PredictedMoment:
    """One moment of the simulated step: its label and the bytes alive by category."""

    label: str  # "forward: L0.attn", "backward: head", "optimizer step"
    state: int  # parameters, buffers and optimizer state
    gradients: int
    activations: int
    temporaries: int  # autocast copies and gradient temporaries, or the optimizer's scratch
    total: int


def _simulate(
    stages: list[Stage], base: int, grads_all: int, accumulate: bool, opt_temp: int,
    moments: list[PredictedMoment] | None = None, steps: dict | None = None,
):  # fmt: skip
    """Walk forward, backward and the optimizer step; return category maxima and the peak.

    ``moments``: a list that receives every moment of the walk (``helpers.timeline``).
    ``steps``: the optimizer steps inside backward (lesson 16), stage name -> (bytes of the
    stage's largest gradient, its step's scratch): each stage's gradients are stepped and
    freed when its backward ends, and there is no optimizer step after backward."""
    walk = _Walk(moments=moments, base=base)
    grads0 = grads_all if accumulate else 0  # later micro-batches find every gradient there
    kept = _forward(stages, walk, base + grads0, grads0)
    _backward(stages, walk, base, grads0, kept, accumulate, steps)
    if steps is None:
        walk.temporaries = max(walk.temporaries, opt_temp)
        walk.seen(base + grads_all + opt_temp, "optimizer step", grads_all, 0, opt_temp)
    return walk.activations, walk.temporaries, walk.copies, walk.peak, walk.where


def _forward(stages: list[Stage], walk: _Walk, floor: int, grads: int = 0) -> int:
    """The forward pass, stage by stage; returns the activation bytes kept for backward.

    Saved tensors pile up; checkpointed layers keep their input only (and free their
    intermediates as they go, so only the stage's transients are added).
    """
    kept = fwd_only = copies = 0
    for st in stages:
        full = sum(st.saved.values())
        extra = sum(st.transient.values())
        if st.region is None:
            here = kept + full + extra
        else:
            here = kept + st.checkpoint_input + extra
        here += fwd_only + sum(st.forward_only.values())
        copies += st.copies
        walk.activations = max(walk.activations, here)
        walk.copies = max(walk.copies, copies)
        walk.seen(floor + here + copies, f"forward: {st.name}", grads, here, copies)
        kept += st.checkpoint_input if st.region is not None else full
        fwd_only += sum(st.forward_only.values())
    walk.temporaries = max(walk.temporaries, copies)
    return kept


def _backward(stages: list[Stage], walk: _Walk, base: int, grads: int, act: int, accumulate,
              steps: dict | None = None):  # fmt: skip
    """Backward: stages in reverse; a checkpointed layer is recomputed when backward reaches
    it. ``grads`` are the gradient bytes already there, ``act`` the activations kept;
    ``steps``: the optimizer steps inside backward (``_simulate``)."""
    copies = sum(st.copies for st in stages if st.region is None)  # autocast's cache is gone
    recomputed: set[int] = set()
    pending = 0  # a tied weight's first gradient, a temporary until the second one is added
    for st in reversed(stages):
        rtemp = st.recompute_temp if st.region is not None else 0
        if st.region is not None and st.region not in recomputed:
            recomputed.add(st.region)
            region = [x for x in stages if x.region == st.region]
            act += sum(sum(x.saved.values()) - x.recompute_temp for x in region)
            act -= sum(x.checkpoint_input for x in region if x.input_in_saved)
            copies += sum(x.copies for x in region)
            walk.activations = max(walk.activations, act + st.recompute_transient)
            walk.copies = max(walk.copies, copies)
        for mom in st.backward or [Moment(0)]:
            done = 0 if accumulate or steps is not None else mom.grads_done
            temp = copies - mom.copies_released + mom.temp + rtemp + pending
            walk.temporaries = max(walk.temporaries, temp)
            alive = act - mom.released
            walk.seen(base + grads + done + alive + temp, f"backward: {st.name}",
                      grads + done, alive, temp)  # fmt: skip
        act -= sum(st.saved.values()) - rtemp
        if st.region is not None and not st.input_in_saved:
            act -= st.checkpoint_input
        copies -= st.copies
        if accumulate and st.largest_grad:
            # Later micro-batches: a parameter's new gradient is a tensor of its own until
            # AccumulateGrad adds it into p.grad; the largest of the stage's, counted as a
            # gradient, with what the stage's backward has left alive.
            new = grads + st.largest_grad
            walk.seen(base + new + act + copies + pending, f"backward: {st.name}", new, act,
                      copies + pending)  # fmt: skip
        if steps is not None:
            pending = _step_in_backward(st, walk, base + act, copies, pending, steps.get(st.name))
            continue
        grads += 0 if accumulate else st.grads
        if st.pending_grads:  # held by autograd until the embedding's gradient is added to it
            pending = st.pending_grads
        elif st.name == "embed" and pending:
            grads += 0 if accumulate else pending
            pending = 0


def _step_in_backward(st: Stage, walk: _Walk, floor: int, copies: int, pending: int, step) -> int:
    """A stage's parameters stepped as its backward ends, one gradient alive at a time (the
    largest, and its step's scratch), over the 16-bit copies of the stages still to come and a
    tied gradient ``pending``; returns the tied gradient still pending after this stage."""
    one, scratch = step or (0, 0)
    if st.name == "embed" and pending:  # the tied weight's two gradients, summed, step here
        one, pending = max(one, pending), 0
    temp = copies + pending + scratch
    if one:
        walk.temporaries = max(walk.temporaries, temp)
        walk.seen(floor + one + temp, f"optimizer step in backward: {st.name}",
                  one, floor - walk.base, temp)  # fmt: skip
    return pending + st.pending_grads
