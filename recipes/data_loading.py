"""Data loading (lesson 11): DataLoader worker processes prepare the next batches while the
model trains, in pinned host memory so the copy to the GPU can overlap the computation.

With num_workers=0 the training loop builds each batch itself, and the device waits for it
every step; here --collate-ms of stand-in preprocessing per batch (a sleep, where a real
pipeline tokenises or decodes) makes that wait visible on any machine. Each worker is a process
that keeps prefetch_factor batches ready, so the wait vanishes once the workers together build
batches faster than a step takes; persistent_workers keeps them alive from one epoch to the
next. Device memory does not change; host memory grows by the workers and their batches
("Methods and tools for efficient training on a single GPU", section "Data preloading",
https://huggingface.co/docs/transformers/perf_train_gpu_one). Trainer:
`TrainingArguments(dataloader_num_workers=4, dataloader_pin_memory=True,
dataloader_persistent_workers=True, dataloader_prefetch_factor=2)`.

    python recipes/data_loading.py --size 400m --seq-len 1024 --collate-ms 200 --workers 0
    python recipes/data_loading.py --size 400m --seq-len 1024 --collate-ms 200 --workers 4
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
    # >>> data loading: worker processes, batches each keeps ready, simulated preprocessing
    p.add_argument("--workers", type=int, default=2, help="DataLoader processes (0: the loop)")
    p.add_argument("--prefetch", type=int, default=2, help="batches each worker keeps ready")
    p.add_argument("--collate-ms", type=float, default=50, help="stand-in preprocessing, ms")
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


# >>> data loading: a collate function that takes --collate-ms per batch, standing in for the
# work a real pipeline does there (tokenising, padding, decoding). A class at module level, so
# that workers started by spawn or forkserver (macOS, Windows, Python 3.14+) can unpickle it.
class SlowCollate:
    def __init__(self, ms: float):
        self.seconds = ms / 1000

    def __call__(self, samples):
        time.sleep(self.seconds)
        return torch.utils.data.default_collate(samples)  # stacks the samples into a batch


# <<<
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
    # >>> data loading: workers build batches in the background (persistent: kept for the next
    # epoch; prefetch_factor only exists with workers), pinned when they go to a CUDA GPU
    workers = args.workers > 0
    loader = DataLoader(
        data,
        batch_size=args.batch_size,
        shuffle=True,
        collate_fn=SlowCollate(args.collate_ms),
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers,
        prefetch_factor=args.prefetch if workers else None,
    )
    # <<<
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return model, optimizer, loader, device


def train(args, model, optimizer, loader, device):
    """The loop: one optimizer step per batch. Returns each step's seconds, from the end of
    the step before (so the wait for the next batch counts: that is where input stalls hide)."""
    model.train()
    times, start = [], time.perf_counter()
    for batch in loader:
        # >>> data loading: batches for a CUDA GPU come pinned, and from pinned memory the copy
        # is asynchronous: the loop goes on while the GPU copies, and the GPU work queued after
        # the copy waits for it
        batch = {k: v.to(device, non_blocking=device.type == "cuda") for k, v in batch.items()}
        # <<<
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
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


if __name__ == "__main__":
    main()
