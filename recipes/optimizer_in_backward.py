"""The optimizer step inside backward (lesson 16): each parameter is updated by its own
optimizer as soon as its gradient is complete, from a hook, and the gradient is freed at once.

The step never holds every gradient: instead of one fp32 gradient per weight (4 bytes per
parameter) at most a few are alive at a time, so the peak drops by about the gradients' size
when it falls in backward or the optimizer step. The weights, optimizer state and activations
are unchanged; the time is about the same (many small steps in place of one batched step).
PyTorch's tutorial "How to save memory by fusing the optimizer step into the backward pass"
(https://pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial.html); the
checkpoint format follows torchtune's OptimizerInBackwardWrapper (torchtune/training/memory.py).
Not supported: gradient accumulation (every backward steps), clipping by the global norm (it
needs every gradient first; clip each tensor in the hook instead), fp16's GradScaler (its
unscale and inf check need every gradient; use bf16). The Trainer steps this way only for its
layer-wise optimizers, TrainingArguments(optim="galore_adamw_layerwise") and the like.

    python recipes/optimizer_in_backward.py --size 1b --batch-size 4 --seq-len 1024 --device cuda
"""

import argparse
import json
import statistics
import time

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM

SIZES = {  # Llama-style shapes: "tiny" runs anywhere in seconds, the others want a GPU
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
    "400m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=8, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               tie_word_embeddings=True),
}  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=SIZES, default="tiny", help="model shape (default tiny)")
    p.add_argument("--config", help="a transformers config.json to build instead of --size")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--attn", default="sdpa", help="attention implementation (sdpa, eager)")
    p.add_argument("--device", help="cpu, cuda, mps... (default: the accelerator, if any)")
    # >>> optimizer step in backward: a warm-up schedule, and a checkpoint to resume from
    p.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warm-up")
    p.add_argument("--checkpoint", help="resume from this file if it exists; save to it at the end")
    # <<<
    return p.parse_args(argv)


class CopyTask(Dataset):
    """Random token ids whose second half repeats the first. A model that learns to copy
    predicts the second half, so the loss falls from ln(vocab) toward half of it."""

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        half = torch.randint(0, vocab_size, (n, (seq_len + 1) // 2), generator=g)
        self.ids = torch.cat([half, half], dim=1)[:, :seq_len]  # (n, seq_len)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}  # the model shifts labels


def build_model(args, device):
    if args.config:
        with open(args.config) as f:
            settings = json.load(f)
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    else:
        config = AutoConfig.for_model("llama", **SIZES[args.size])
    config.use_cache = False  # training keeps no KV cache
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn)
    return model.to(device)


# >>> optimizer step in backward: one optimizer and one LR schedule per parameter; a hook steps
# the parameter and frees its gradient as soon as backward has accumulated it.
class OptimizerInBackward:
    def __init__(self, model, make_optimizer, make_schedule):
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.optimizers = {n: make_optimizer([p]) for n, p in params.items()}  # by name
        self.schedules = {n: make_schedule(opt) for n, opt in self.optimizers.items()}
        self.of_param = {p: self.optimizers[n] for n, p in params.items()}
        for p in params.values():
            p.register_post_accumulate_grad_hook(self.step_one)

    def step_one(self, param):
        """Called by backward once ``param.grad`` is complete."""
        self.of_param[param].step()
        self.of_param[param].zero_grad(set_to_none=True)  # frees the gradient now

    def step_schedules(self):
        for schedule in self.schedules.values():
            schedule.step()

    def state_dict(self):
        """Every parameter's optimizer and schedule state, by parameter name."""
        return {n: {"optimizer": opt.state_dict(), "schedule": self.schedules[n].state_dict()}
                for n, opt in self.optimizers.items()}  # fmt: skip

    def load_state_dict(self, state):
        if state.keys() != self.optimizers.keys():
            raise KeyError(
                f"the checkpoint's parameters differ: {state.keys() ^ self.optimizers.keys()}"
            )
        for n, saved in state.items():
            self.optimizers[n].load_state_dict(saved["optimizer"])
            self.schedules[n].load_state_dict(saved["schedule"])


# <<<
def build(args):
    """The model, the optimizer and the data: everything the loop needs."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None: no GPU
    device = torch.device(args.device or accelerator or "cpu")
    model = build_model(args, device)
    data = CopyTask(args.batch_size * args.steps, args.seq_len, model.config.vocab_size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    # >>> optimizer step in backward: AdamW and a linear warm-up for each parameter; resume the
    # weights, every optimizer and every schedule from --checkpoint if it exists
    optimizer = OptimizerInBackward(
        model,
        lambda params: torch.optim.AdamW(params, lr=args.lr),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1, (s + 1) / (args.warmup + 1))
        ),
    )
    try:  # a first run finds no file yet
        saved = torch.load(args.checkpoint, map_location=device) if args.checkpoint else None
    except FileNotFoundError:
        saved = None
    if saved:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        print(f"resumed from {args.checkpoint}")
    # <<<
    return model, optimizer, loader, device


def train(args, model, optimizer, loader, device):
    """The loop: one optimizer step per batch. Returns each step's seconds, from the end of
    the step before (so the wait for the next batch counts: that is where input stalls hide)."""
    model.train()
    times, start = [], time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        # >>> optimizer step in backward: backward() has already updated every weight and freed
        # its gradient (the hooks), so no optimizer.step() or zero_grad() here; only the
        # learning-rate schedules advance, once per step.
        optimizer.step_schedules()
        # <<<
        loss = loss.item()  # waits for the device, so the step's time is complete
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        print(f"step {len(times)}  loss {loss:.3f}  {times[-1] * 1e3:.0f} ms")
    return times


def report(args, times, device):
    """Tokens per second after the first step (which also allocates and warms up)."""
    step_s = statistics.median(times[1:] or times)
    tokens = args.batch_size * args.seq_len
    line = f"{tokens / step_s:,.0f} tokens/s, median step {step_s * 1e3:.0f} ms"
    if device.type == "cuda":
        line += f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated"
    print(line)


def main(argv=None):
    args = parse_args(argv)
    model, optimizer, loader, device = build(args)
    times = train(args, model, optimizer, loader, device)
    report(args, times, device)
    # >>> optimizer step in backward: a checkpoint holds the weights and every optimizer
    if args.checkpoint:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   args.checkpoint)  # fmt: skip
    # <<<


if __name__ == "__main__":
    main()
