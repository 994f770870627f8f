"""Seeing memory (lesson 15): torch.profiler records one training step's allocations, by
operator and over time, and on a CUDA GPU the allocator's own history is saved as a snapshot.

It changes no training memory; the recorded step runs slower (shapes and Python stacks are
kept for every operator), so the step time it reports includes that. Files, in --out:
trace.json (open in https://ui.perfetto.dev), memory_timeline.html (the step's bytes by
category: parameters, gradients, optimizer state, activations, as in "Model training anatomy",
https://huggingface.co/docs/transformers/model_memory_anatomy) and on CUDA snapshot.pickle
(drag it onto https://pytorch.org/memory_viz). Sources: PyTorch's "torch.profiler",
https://docs.pytorch.org/docs/stable/profiler.html, and "Understanding CUDA Memory Usage",
https://docs.pytorch.org/docs/stable/torch_cuda_memory.html. The Trainer has no switch for it:
call prof.step() from a TrainerCallback's on_step_end.

    python recipes/profile_memory.py --size 1b --batch-size 4 --seq-len 1024 --out profile/
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
    # >>> memory profiling: where the trace, the timeline and the snapshot go
    p.add_argument("--out", default=".", help="folder for the files (default: here)")
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
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None: no GPU
    device = torch.device(args.device or accelerator or "cpu")
    model = build_model(args, device)
    data = CopyTask(args.batch_size * args.steps, args.seq_len, model.config.vocab_size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return model, optimizer, loader, device


def train(args, model, optimizer, loader, device):
    """The loop: one optimizer step per batch. Returns each step's seconds, from the end of
    the step before (so the wait for the next batch counts: that is where input stalls hide)."""
    model.train()
    # >>> memory profiling: step 1 warms the profiler up, step 2 is recorded (the schedule
    # counts prof.step() calls); every allocation and free is kept with its operator, shapes
    # and Python stack. On CUDA the allocator also records its history, for the snapshot
    # (the last 100,000 events, with Python frames; stacks="all" adds C++ frames).
    import os

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    prof = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1),
        profile_memory=True,
        record_shapes=True,
        with_stack=True,
    )
    prof.start()
    # <<<
    times, start = [], time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.item()  # waits for the device, so the step's time is complete
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        print(f"step {len(times)}  loss {loss:.3f}  {times[-1] * 1e3:.0f} ms")
        # >>> memory profiling: a step ended
        prof.step()
        # <<<
    # >>> memory profiling: the operators that allocated most in the recorded step (net bytes,
    # callees left out; "cuda" was the older name of "device"), then the files
    prof.stop()
    key = "self_device_memory_usage" if device.type == "cuda" else "self_cpu_memory_usage"
    print(prof.key_averages().table(sort_by=key, row_limit=10))
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.out, "trace.json"))
    # The timeline's plot needs matplotlib; torch 2.13 marks it deprecated in favour of the
    # CUDA snapshot below, but on a CPU it is the only timeline.
    where = "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
    prof.export_memory_timeline(os.path.join(args.out, "memory_timeline.html"), device=where)
    if device.type == "cuda":
        torch.cuda.memory._dump_snapshot(os.path.join(args.out, "snapshot.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
        print("snapshot.pickle: drag it onto https://pytorch.org/memory_viz")
    else:
        print("no snapshot.pickle: the allocator's memory history exists on CUDA only")
    # <<<
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


if __name__ == "__main__":
    main()
