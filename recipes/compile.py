"""torch.compile (lesson 12): `model = torch.compile(model)` captures the forward as graphs,
and inductor compiles them, with the backward AOTAutograd derives, into fused kernels.

Fusion runs a chain of element-wise operations (norms, activations, residual adds) as one pass
over memory instead of one pass each, so steps get faster, by an amount that depends on the
model and the device; activations may shrink a little where the compiler recomputes cheap
operations in backward rather than saving them. The price is the first step, which traces and
compiles (the report's median leaves that step out and prints it apart), and a recompile when
an input shape changes. On a CPU this script defaults to the aot_eager backend, which captures
the graphs but generates no code; --backend inductor compiles C++ there (about a minute, cold,
for the tiny model on two busy cores). --mode reduce-overhead adds CUDA graphs, max-autotune
tries kernel variants and adds CUDA graphs too (max-autotune-no-cudagraphs without them;
torch._inductor.list_mode_options) ("Methods and tools for efficient training on a single
GPU", section "torch.compile", https://huggingface.co/docs/transformers/perf_train_gpu_one).
Trainer:
`TrainingArguments(torch_compile=True)`, with torch_compile_backend and torch_compile_mode.

    python recipes/compile.py --size 400m --batch-size 8 --seq-len 1024 --steps 20 --device cuda
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
    # >>> torch.compile: inductor's mode, and the compiler. inductor generates kernels (Triton
    # on a GPU, C++ on a CPU: about a minute of gcc for the tiny model on two cores, cached
    # for later runs); aot_eager captures the same forward and backward graphs and runs them
    # op by op: no speed-up (here on a CPU, slower than eager), but the capture, its graph
    # breaks and recompiles, in seconds.
    p.add_argument("--mode", choices=["default", "reduce-overhead", "max-autotune"],
                   default="default")  # fmt: skip
    p.add_argument("--backend", choices=["inductor", "aot_eager", "eager"],
                   help="default: aot_eager on a CPU, inductor elsewhere")  # fmt: skip
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
    # >>> torch.compile: compiles lazily, at the first call; the optimizer can take the
    # compiled model's parameters, which are the model's own. To see where the capture
    # breaks into several graphs (each break costs speed): TORCH_LOGS=graph_breaks python
    # recipes/compile.py, or torch._dynamo.explain(model)(**batch) on one batch.
    backend = args.backend or ("aot_eager" if device.type == "cpu" else "inductor")
    mode = args.mode if backend == "inductor" else None  # the modes are inductor's
    model = torch.compile(model, backend=backend, mode=mode)
    # <<<
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
    # >>> torch.compile: the first step also traced and compiled the model
    print(f"first step {times[0]:.1f} s, compilation included")
    # <<<


def main(argv=None):
    args = parse_args(argv)
    model, optimizer, loader, device = build(args)
    times = train(args, model, optimizer, loader, device)
    report(args, times, device)


if __name__ == "__main__":
    main()
