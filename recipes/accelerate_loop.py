"""Hugging Face Accelerate (lesson 07): one loop for a CPU, one GPU or several processes;
Accelerate places the model and batches and applies mixed precision and accumulation.

prepare() itself saves no memory and costs no time (on several processes it wraps the model in
DDP and gives each process its share of the batches). The flags change memory and time:
--mixed-precision bf16 runs the forward under autocast (most activations in 16 bits, weights and
optimizer state in fp32, matmuls on a GPU's fast 16-bit units), --accumulate k steps once per k
micro-batches ("Methods and tools for efficient training on a single GPU", section "Using 🤗
Accelerate", https://huggingface.co/docs/transformers/perf_train_gpu_one; Accelerate's
"Gradient accumulation" guide, https://huggingface.co/docs/accelerate/usage_guides/gradient_accumulation).
The Trainer runs on Accelerate: `TrainingArguments(bf16=True, gradient_accumulation_steps=k)`.
Lesson 07 also uses an 8-bit optimizer and checkpointing: add optimizers.py's and
checkpointing.py's blocks to this file (mixed_precision.py and accumulation.py teach the flags).
--checkpoint DIR resumes from DIR's save_state (weights, optimizer, RNG states), if any, and
saves there after the last step: run it twice and the second run goes on as the first run's
next epoch would have (Accelerate's "Checkpointing" guide,
https://huggingface.co/docs/accelerate/usage_guides/checkpoint).

    python recipes/accelerate_loop.py --size 1b --seq-len 1024 --mixed-precision bf16 --accumulate 8
    accelerate launch --num_processes 2 recipes/accelerate_loop.py --mixed-precision bf16  # 2 GPUs
    accelerate launch --num_processes 2 --cpu recipes/accelerate_loop.py  # 2 CPU processes
    python recipes/accelerate_loop.py --checkpoint state  # again: resumes from state/
"""

import argparse
import json
import statistics
import time

# >>> Accelerate: the library that runs the loop
import accelerate

# <<<
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
    # >>> Accelerate: its mixed precision (autocast; fp16 adds a GradScaler) and the number
    # of micro-batches per optimizer step
    p.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"),
                   help="default: accelerate launch's --mixed_precision, else no")  # fmt: skip
    p.add_argument("--accumulate", type=int, default=1)
    # <<<
    # >>> checkpoint and resume
    p.add_argument("--checkpoint", metavar="DIR", help="resume from DIR if saved, save there")
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


def build(args):
    """The model, the optimizer and the data: everything the loop needs."""
    # >>> Accelerate: it picks the device (under a launcher, this process's GPU); --device cpu
    # (or accelerate launch --cpu) forces the CPU, any other --device is left to Accelerate.
    # train() and report() reach the Accelerator through args: the base's signatures stay.
    accelerator = accelerate.Accelerator(
        cpu=args.device == "cpu",
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.accumulate,
    )
    args.accelerator, device = accelerator, accelerator.device
    if accelerator.mixed_precision == "fp16" and device.type == "cpu":  # would train in fp32
        import sys

        sys.exit("needs a GPU for --mixed-precision fp16 (on the CPU: bf16)")
    # <<<
    model = build_model(args, device)
    # >>> Accelerate: k micro-batches per step for every process (prepare() shards the loader)
    k = accelerator.gradient_accumulation_steps
    n = args.batch_size * k * args.steps * accelerator.num_processes
    data = CopyTask(n, args.seq_len, model.config.vocab_size)
    # <<<
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # >>> Accelerate: device placement, DDP on several processes, a per-process loader that
    # puts batches on the device, an optimizer that steps only at a window's end
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # <<<
    # >>> checkpoint and resume: into the prepared objects, before the epoch's first batch
    # draws its seed (and shuffle order) from torch's RNG, as the saved run's next epoch would
    import os

    if args.checkpoint and os.path.isdir(args.checkpoint):
        accelerator.load_state(args.checkpoint)  # weights, optimizer, RNG states
    # <<<
    return model, optimizer, loader, device


def train(args, model, optimizer, loader, device):
    """The loop: one optimizer step per batch. Returns each step's seconds, from the end of
    the step before (so the wait for the next batch counts: that is where input stalls hide)."""
    model.train()
    times, start = [], time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        # >>> Accelerate: accelerator.backward() divides the loss by k, inside accumulate() or
        # not (a plain loss.backward() would not), and scales it for fp16; accumulate() lets
        # step() and zero_grad() act, and DDP all-reduce the gradients, only on a window's last
        # micro-batch (accelerator.sync_gradients)
        with args.accelerator.accumulate(model):
            loss = model(**batch).loss
            args.accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if not args.accelerator.sync_gradients:
            continue
        # <<<
        loss = loss.item()  # waits for the device, so the step's time is complete
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        # >>> Accelerate: only the main process prints (its own micro-batch's loss)
        args.accelerator.print(f"step {len(times)}  loss {loss:.3f}  {times[-1] * 1e3:.0f} ms")
        # <<<
    return times


def report(args, times, device):
    """Tokens per second after the first step (which also allocates and warms up)."""
    step_s = statistics.median(times[1:] or times)
    tokens = args.batch_size * args.seq_len
    # >>> Accelerate: a step trains k micro-batches on every process
    tokens *= args.accelerator.gradient_accumulation_steps * args.accelerator.num_processes
    # <<<
    line = f"{tokens / step_s:,.0f} tokens/s, median step {step_s * 1e3:.0f} ms"
    if device.type == "cuda":
        line += f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated"
    # >>> Accelerate: the main process reports (the peak is its own GPU's)
    args.accelerator.print(line)
    # <<<


def main(argv=None):
    args = parse_args(argv)
    model, optimizer, loader, device = build(args)
    times = train(args, model, optimizer, loader, device)
    report(args, times, device)
    # >>> checkpoint and resume: the main process writes the weights and optimizer state, each
    # process its RNG states
    if args.checkpoint:
        args.accelerator.save_state(args.checkpoint)
    # <<<
    # >>> Accelerate: ends the run (destroys the process group under a launcher)
    args.accelerator.end_training()
    # <<<


if __name__ == "__main__":
    main()
