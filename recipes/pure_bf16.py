"""bf16 weights with no master copy (lesson 05): weights, gradients and AdamW's state in bf16.

Mixed precision (recipes/mixed_precision.py) keeps fp32 weights and AdamW's fp32 moments, 16
bytes per parameter before activations; here the model is built in bf16, as
`from_pretrained(..., dtype=torch.bfloat16)` loads it, and trains as it is: 2 bytes of weight,
2 of gradient, 4 of AdamW state. The catch is rounding: bf16 keeps 8 significant bits, so an
update smaller than half the gap between a weight and its bf16 neighbour is lost, and at a
small learning rate training stalls. Two optimizers repair the update: torch-optimi's AdamW
with `kahan_sum=True` keeps what each rounding lost in one more bf16 buffer (2 bytes per
parameter) and adds it back; torchao's AdamW with `bf16_stochastic_round=True` rounds the fp32
result up or down at random, with the odds of its distance to each neighbour, so no update is
lost on average. Trainer: load the model with `dtype=torch.bfloat16`, `bf16=True`, and pass the
optimizer (`optimizers=(optimizer, None)`).

    python recipes/pure_bf16.py --update kahan --lr 1e-4      # nearest, stochastic (torchao)
    python recipes/pure_bf16.py --size 1b --batch-size 4 --seq-len 1024 --device cuda
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
    # >>> pure bf16: how AdamW updates a bf16 weight (nearest: torch's AdamW, plain rounding)
    p.add_argument("--update", choices=["kahan", "stochastic", "nearest"], default="kahan")
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
    # >>> pure bf16: the weights are built (or loaded) in bf16, and so are their gradients
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=args.attn, dtype=torch.bfloat16
    )
    # <<<
    return model.to(device)


def build(args):
    """The model, the optimizer and the data: everything the loop needs."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None: no GPU
    device = torch.device(args.device or accelerator or "cpu")
    model = build_model(args, device)
    data = CopyTask(args.batch_size * args.steps, args.seq_len, model.config.vocab_size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    # >>> pure bf16: an AdamW whose update survives bf16 rounding. Each keeps its moments in
    # the weights' dtype, bf16 (SystemExit(message) exits without a traceback).
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        raise SystemExit("needs compute capability 8.0+ for bf16 weights")
    if args.update == "kahan":
        try:
            import optimi
        except ImportError:
            raise SystemExit("pure_bf16.py --update kahan needs pip install torch-optimi") from None
        # torch's AdamW defaults (optimi's own are betas (0.9, 0.99) and eps 1e-6), one tensor
        # at a time; kahan_sum keeps each update's rounding error in a bf16 buffer, kahan_comp.
        optimizer = optimi.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=0.01, kahan_sum=True, foreach=False,
                                 triton=False)  # fmt: skip
    elif args.update == "stochastic":
        try:
            from torchao.optim import _AdamW  # torchao's name for its full-state AdamW
        except ImportError:
            raise SystemExit("pure_bf16.py --update stochastic needs pip install torchao") from None
        optimizer = _AdamW(model.parameters(), lr=args.lr, bf16_stochastic_round=True)
        if device.type == "cpu":  # torchao compiles its step per weight shape: seconds on a CPU
            compiled_step = optimizer.step

            def eager_step(closure=None):
                with torch.compiler.set_stance("force_eager"):  # the same update, eagerly
                    return compiled_step(closure)

            optimizer.step = eager_step
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # <<<
    return model, optimizer, loader, device


def train(args, model, optimizer, loader, device):
    """The loop: one optimizer step per batch. Returns each step's seconds, from the end of
    the step before (so the wait for the next batch counts: that is where input stalls hide)."""
    model.train()
    times, start = [], time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        # >>> pure bf16: autocast over bf16 weights, as the Trainer's bf16=True runs it (the
        # matmuls are bf16 anyway; on a GPU autocast keeps softmax and norms in fp32)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        # <<<
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
