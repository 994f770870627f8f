"""Chunked loss (lesson 16): the causal LM loss computed `--chunk` tokens at a time from the
model's final hidden states, each chunk's logits made, used and freed inside a checkpoint.

The full (batch, sequence, vocabulary) logits never exist at once, nor their fp32 copy and
the log-softmax and gradient of the same size: with Llama 3's 128k vocabulary those are the
largest tensors of a step (batch 4 x 1024 tokens: about 2 GiB per fp32 copy). The output
layer's forward runs again in backward, a third more of its FLOPs. The loss is the model's own:
per-chunk sums over the number of predicted tokens (checked at the end). PyTorch docs,
"torch.utils.checkpoint" (https://docs.pytorch.org/docs/stable/checkpoint.html). The fused
alternative writes no logits at all: "Liger Kernel: Efficient Triton Kernels for LLM Training",
its fused linear cross-entropy (https://arxiv.org/abs/2410.10989; pip install liger-kernel,
not installed here), in the Trainer TrainingArguments(use_liger_kernel=True).

    python recipes/chunked_loss.py --size 1b --batch-size 4 --seq-len 1024 --chunk 1024
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
    # >>> chunked loss: tokens of logits at a time (a GPU: 1024-4096; small here, to chunk)
    p.add_argument("--chunk", type=int, default=128)
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


# >>> chunked loss: the loss a chunk at a time. The checkpoint keeps only each chunk's hidden
# states and recomputes its logits in backward, so one chunk's logits exist at a time.
def chunk_loss(head, hidden, targets):
    """One chunk's summed loss: its logits exist only inside this function."""
    logits = head(hidden).float()  # fp32, as transformers' loss upcasts
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


def chunked_loss(model, batch, chunk):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = model.get_decoder()(**inputs).last_hidden_state.flatten(0, 1)  # no logits yet
    # position i predicts label i + 1, as the model shifts; a row's last position predicts none
    targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:].flatten()
    total = 0
    for i in range(0, len(targets), chunk):
        total = total + torch.utils.checkpoint.checkpoint(
            chunk_loss, model.get_output_embeddings(), hidden[i : i + chunk],
            targets[i : i + chunk], use_reentrant=False)  # fmt: skip
    return total / (targets != -100).sum()


# <<<
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
    times, start = [], time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        # >>> chunked loss: in place of model(**batch).loss, which makes all the logits at once
        loss = chunked_loss(model, batch, args.chunk)
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
    # >>> chunked loss: the same loss as the model's own (one row; after the run, so the full
    # logits made here do not count in the peak above)
    row = {k: v[:1].to(device) for k, v in next(iter(loader)).items()}
    with torch.no_grad():
        chunked, full = chunked_loss(model, row, args.chunk), model(**row).loss
    torch.testing.assert_close(chunked, full, rtol=1e-4, atol=0)  # float sums: order differs
    print("chunked loss = model(**batch).loss")
    # <<<


if __name__ == "__main__":
    main()
