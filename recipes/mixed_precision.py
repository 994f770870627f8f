"""Mixed precision (lesson 05): the forward pass runs under torch.autocast, which does each
matmul in 16 bits, while the weights, their gradients and AdamW's state stay fp32.

Activations kept for backward are mostly 16-bit, so at a large batch they need about half the
bytes, and tensor cores multiply bf16/fp16 several times faster than fp32. The weights are not
converted: autocast makes a 16-bit copy of each weight when a matmul uses it and keeps it for
the backward, so at a small batch the peak can even rise. fp16's narrow range needs a
GradScaler (the loss is scaled up so small gradients do not round to zero, and a step whose
gradients overflow is skipped); bf16 has fp32's range and needs none ("Methods and tools for
efficient training on a single GPU", section "Mixed precision",
https://huggingface.co/docs/transformers/perf_train_gpu_one). Trainer:
`TrainingArguments(bf16=True)` or `fp16=True`; `tf32=True` is this script's --precision tf32.

    python recipes/mixed_precision.py --size 1b --batch-size 4 --seq-len 1024 --device cuda
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
    # >>> mixed precision: the 16-bit format of the matmuls (tf32: fp32 code, NVIDIA only)
    p.add_argument("--precision", choices=["bf16", "fp16", "tf32"], default="bf16")
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
    # >>> mixed precision: what a GPU must support (SystemExit(message) exits without a
    # traceback, as sys.exit does). tf32 is no dtype but a mode of NVIDIA tensor cores from
    # Ampere (compute capability 8.0) on: fp32 tensors whose matmul inputs are rounded to 10
    # mantissa bits. It is set with PyTorch's fp32_precision API, as lesson 05 does; do not mix
    # it with the legacy switches (torch.backends.cuda.matmul.allow_tf32,
    # torch.set_float32_matmul_precision): reading a legacy one after this raises an error.
    # A CPU runs bf16 and fp16 autocast, in slow emulation where it lacks the instructions.
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if args.precision == "tf32":
        if capability is None or capability < (8, 0):
            raise SystemExit("needs an NVIDIA GPU of compute capability 8.0+ for --precision tf32")
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # fp32 matmuls may use tf32
    if args.precision == "bf16" and capability is not None and capability < (8, 0):
        raise SystemExit("needs compute capability 8.0+ for bf16: use --precision fp16")
    # <<<
    model = build_model(args, device)
    data = CopyTask(args.batch_size * args.steps, args.seq_len, model.config.vocab_size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return model, optimizer, loader, device


def train(args, model, optimizer, loader, device):
    """The loop: one optimizer step per batch. Returns each step's seconds, from the end of
    the step before (so the wait for the next batch counts: that is where input stalls hide)."""
    model.train()
    # >>> mixed precision: the autocast format (None for tf32: no autocast), and a GradScaler
    # that only fp16 needs (disabled, its calls below pass the loss and the step straight on)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    # <<<
    times, start = [], time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        # >>> mixed precision: only the forward (and the loss) runs under autocast; backward
        # follows the formats the forward chose. The scaler multiplies the loss before
        # backward, divides the gradients before the step, skips a step with inf/nan
        # gradients and adjusts its scale.
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        # <<<
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
