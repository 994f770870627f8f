r"""Attention kernels (lesson 10): the attention implementation transformers calls (--attn)
and, for SDPA, the kernel torch.nn.functional.scaled_dot_product_attention may use (--backend).

The math kernel builds each head's (seq x seq) score matrix and keeps it for backward, so
attention's activation memory grows with the square of the sequence length. The flash,
memory-efficient and cuDNN kernels work tile by tile, keep only the output and a statistic
per row, and recompute the scores in backward: memory grows linearly, and long sequences run
faster. A CPU has the math and flash kernels; on an NVIDIA GPU flash and cuDNN take only
fp16/bf16 inputs, hence --precision bf16 ("Methods and tools for efficient training on a
single GPU", section "Scaled dot production attention",
https://huggingface.co/docs/transformers/perf_train_gpu_one). No TrainingArguments switch:
the model is loaded with `attn_implementation="sdpa"` (or "flash_attention_2", "eager").

    python recipes/attention.py --size 400m --batch-size 1 --seq-len 4096 --precision bf16 \
        --backend flash    # then --backend math: the scores kept, more memory, slower
"""

import argparse
import json
import statistics
import time

# >>> attention: sdpa_kernel restricts SDPA to chosen kernels; is_flash_attn_2_available
# tells whether transformers can use the flash-attn package
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import is_flash_attn_2_available

# SDPA's kernels by this script's names
BACKENDS = {
    "math": SDPBackend.MATH,  # plain PyTorch operations: stores the (seq x seq) scores
    "efficient": SDPBackend.EFFICIENT_ATTENTION,  # memory-efficient (xFormers') kernel: CUDA
    "flash": SDPBackend.FLASH_ATTENTION,  # FlashAttention-2: CUDA (16-bit); CPU (fp32 too)
    "cudnn": SDPBackend.CUDNN_ATTENTION,  # cuDNN's fused attention: recent NVIDIA GPUs
}

# <<<
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
    # >>> attention: the implementation, SDPA's kernel (auto: PyTorch picks one per call),
    # and bf16 autocast for the forward, which the GPU's flash and cuDNN kernels need
    p.add_argument("--attn", default="sdpa", help="sdpa, eager or flash_attention_2 (flash-attn)")
    p.add_argument("--backend", choices=["auto", *BACKENDS], default="auto")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    # <<<
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
    return model.to(device)


def build(args):
    """The model, the optimizer and the data: everything the loop needs."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None: no GPU
    device = torch.device(args.device or accelerator or "cpu")
    # >>> attention: what the chosen kernel needs (SystemExit(message) exits without a
    # traceback, as sys.exit does). Other limits of a GPU's kernels (its architecture, the
    # head size) make SDPA raise "No available kernel" after warnings that say why.
    if args.backend in ("efficient", "cudnn") and device.type != "cuda":
        raise SystemExit(
            f"needs an NVIDIA GPU for SDPA's {args.backend} kernel (a CPU has math, flash)"
        )
    if args.backend in ("flash", "cudnn") and device.type == "cuda" and args.precision == "fp32":
        raise SystemExit(
            f"needs 16-bit inputs for the GPU's {args.backend} kernel: add --precision bf16"
        )
    if args.attn == "flash_attention_2":  # the flash-attn package, through transformers
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
            raise SystemExit("needs an NVIDIA GPU of compute capability 8.0+ for flash_attention_2")
        if not is_flash_attn_2_available():
            raise SystemExit(
                "attention.py --attn flash_attention_2 needs flash-attn: "
                "pip install flash-attn --no-build-isolation"
            )
        if args.precision == "fp32":
            raise SystemExit("needs 16-bit inputs for flash_attention_2: add --precision bf16")
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
        # >>> attention: SDPA may use only the chosen kernel, in the forward and in the
        # backward (which runs the backward of the kernel the forward used); auto allows all.
        # The forward is autocast to bf16 with --precision bf16.
        kernels = list(BACKENDS.values()) if args.backend == "auto" else BACKENDS[args.backend]
        with sdpa_kernel(kernels):
            with torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "bf16"):
                loss = model(**batch).loss
            loss.backward()
        # <<<
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
