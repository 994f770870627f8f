"""fp8 training (lesson 16): torchao swaps the Linear layers for Float8Linear, whose three
matmuls (forward, and the two of backward) cast their inputs to float8 with one scale per tensor.

It saves time, not memory: float8 tensor cores multiply about twice as fast as bf16 ones, on
GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell). The weights stay in their
dtype, each layer still saves its high-precision input for backward, and the float8 copies live
only inside a layer, so the peak barely moves. The casts cost time of their own: torch.compile
fuses them (without it fp8 is slower than bf16), and only large matmuls (hidden size in the
thousands) gain; real runs pair it with bf16 autocast (recipes/mixed_precision.py). torchao's
"float8" README (https://github.com/pytorch/ao/tree/main/torchao/float8). With Accelerate:
Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()]).

    python recipes/fp8.py --size 1b --batch-size 4 --seq-len 2048 --steps 20  # an H100, L4, 4090
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
    # >>> fp8: every Linear layer but the output layer (the loss is most sensitive to its
    # precision) becomes a Float8Linear, if both its sizes are multiples of 16 (float8 matmuls
    # need that); then torch.compile, which fuses the casts and scales into few kernels.
    import sys

    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        sys.exit("fp8.py needs torchao: pip install torchao")

    def to_float8(module, name):
        return name != "lm_head" and module.in_features % 16 == 0 and module.out_features % 16 == 0

    model = model.to(device)
    convert_to_float8_training(model, module_filter_fn=to_float8)
    return torch.compile(model)
    # <<<


def build(args):
    """The model, the optimizer and the data: everything the loop needs."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None: no GPU
    device = torch.device(args.device or accelerator or "cpu")
    # >>> fp8: the hardware first: without float8 tensor cores installing torchao would not help
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        import sys

        found = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        sys.exit("needs an NVIDIA GPU of compute capability 8.9 or newer (Hopper, Ada): float8 "
                 f"matmuls run on their tensor cores; this is {found}")  # fmt: skip
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
