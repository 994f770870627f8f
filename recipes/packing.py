"""Padding-free batches (lesson 16): each batch's documents are concatenated into one row by
transformers' DataCollatorWithFlattening, with position ids that restart at every document.

A padded batch spends every layer's memory and FLOPs on pads up to its longest document; the
packed row holds only real tokens, so activations and time follow the tokens trained on.
What keeps documents apart depends on the attention: flash_attention_2 (CUDA, pip install
flash-attn) gets their boundaries (cu_seq_lens) from the collator and runs flash-attn's varlen
kernel, each document attending to itself only, no mask. sdpa and eager (here, on the CPU) get
position_ids and no attention_mask: transformers' masking_utils.find_packed_sequence_indices
finds the restarts and builds a block-diagonal causal mask, so the outputs are the padded
batch's, but attention still scores the whole row and a dense mask rules out SDPA's flash kernel.
Without position_ids, or with a KV cache, the row would be one long document. "Enhancing
Training Efficiency Using Packing with Flash Attention" (https://arxiv.org/abs/2407.09105). In
the Trainer: data_collator=DataCollatorWithFlattening() (TRL: SFTConfig(padding_free=True)).

    python recipes/packing.py --size 400m --batch-size 16 --seq-len 2048 --attn flash_attention_2
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


# >>> packing: documents of varied length in place of CopyTask's equal rows, log-uniform from
# seq_len / 8 to seq_len tokens (many short, a few long), each a random half and its copy.
class Documents(Dataset):
    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        low = max(2, seq_len // 8)
        lengths = (low * (seq_len / low) ** torch.rand(n, generator=g)).long().tolist()
        halves = [torch.randint(0, vocab_size, ((k + 1) // 2,), generator=g) for k in lengths]
        self.docs = [torch.cat([h, h])[:k] for h, k in zip(halves, lengths, strict=True)]

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return {"input_ids": self.docs[i]}  # the collator makes the labels


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
    # >>> packing: flash_attention_2 needs a CUDA GPU and the flash-attn package
    if args.attn == "flash_attention_2":
        import importlib.util
        import sys

        if device.type != "cuda":
            sys.exit(f"needs a CUDA GPU for --attn flash_attention_2 (this is {device})")
        if importlib.util.find_spec("flash_attn") is None:
            sys.exit("packing.py --attn flash_attention_2 needs flash-attn: pip install flash-attn")
    # <<<
    model = build_model(args, device)
    # >>> packing: one row per batch. Labels are the ids with -100 at each document's first
    # token (nothing predicts it from the document before); flash attention also gets the
    # boundaries. Then what the same batches would pad to: documents x the longest, per batch.
    from transformers import DataCollatorWithFlattening

    data = Documents(args.batch_size * args.steps, args.seq_len, model.config.vocab_size)
    flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=args.attn.startswith("flash"))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, collate_fn=flatten)
    tokens = sum(len(doc) for doc in data.docs)
    padded = sum(int((b["position_ids"] == 0).sum()) * (int(b["position_ids"].max()) + 1)
                 for b in loader)  # fmt: skip
    print(f"{tokens:,} tokens in {len(loader)} packed rows; padded batches: {padded:,} positions,"
          f" {1 - tokens / padded:.0%} of them padding, avoided")  # fmt: skip
    args.tokens_per_step = tokens / len(loader)  # for report(): the tokens trained on
    # <<<
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return model, optimizer, loader, device


def train(args, model, optimizer, loader, device):
    """The loop: one optimizer step per batch. Returns each step's seconds, from the end of
    the step before (so the wait for the next batch counts: that is where input stalls hide)."""
    model.train()
    times, start = [], time.perf_counter()
    for batch in loader:
        # >>> packing: the collator's max_length_q/k (flash attention) are ints, not tensors
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
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
    # >>> packing: a step trains on its documents' tokens, fewer than batch x seq-len
    tokens = args.tokens_per_step
    # <<<
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
