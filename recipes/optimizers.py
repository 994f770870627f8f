"""Optimizers with less state (lesson 06): Adafactor, 8-bit AdamW, Lion or Muon for AdamW.

AdamW keeps two fp32 moments per weight, 8 bytes per parameter: twice the weights' own bytes.
torch.optim.Adafactor (torch 2.5+) keeps no first moment and stores the second as one row and
one column per matrix, so its state nearly vanishes; bitsandbytes' AdamW8bit keeps both
moments in 8 bits with one scale per block of 256 values, about 2 bytes per parameter. The
saving shows at the optimizer step, when the state is allocated; the step's time hardly
changes ("Methods and tools for efficient training on a single GPU", section "Optimizers",
https://huggingface.co/docs/transformers/perf_train_gpu_one). Trainer:
`optim="adafactor"` (transformers' own Adafactor, which takes an AdamW-like rate such as 1e-3)
or `optim="adamw_bnb_8bit"`. Lion (bitsandbytes; `optim="lion_32bit"`, `"lion_8bit"`) keeps
one moment, 4 or about 1 byte per parameter; torch.optim.Muon keeps one momentum buffer for
the hidden layers' matrices and leaves the rest to AdamW (transformers has no `optim=` name
for it).

    python recipes/optimizers.py --size 1b --batch-size 4 --seq-len 1024 --optim adamw8bit
    python recipes/optimizers.py --optim muon
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
    # >>> optimizers: which optimizer replaces AdamW
    p.add_argument("--optim", choices=["adafactor", "adamw8bit", "lion", "lion8bit", "muon"],
                   default="adafactor")  # fmt: skip
    # <<<
    return p.parse_args(argv)


# >>> optimizers: Muon's parameters and AdamW's, and the two stepped as one (--optim muon)
def muon_split(model):
    """Muon's parameters, the hidden layers' 2-D matrices, and AdamW's: embeddings, the output
    head and vectors (norms, biases), as torch's docs and Muon's authors advise."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    muon = [p for p in model.base_model.parameters() if p.ndim == 2 and id(p) not in embeddings]
    return muon, [p for p in model.parameters() if all(p is not q for q in muon)]


class MuonAndAdamW:
    """Several optimizers where the loop expects one: step() and zero_grad() reach each."""

    def __init__(self, **optimizers):
        self.optimizers = optimizers

    def step(self):
        for optimizer in self.optimizers.values():
            optimizer.step()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)


# <<<
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
    # >>> optimizers: Adafactor, 8-bit AdamW, Lion or Muon in place of AdamW (SystemExit(message)
    # exits without a traceback, as sys.exit does)
    if args.optim == "adafactor":
        # torch's Adafactor scales each step by the weight's RMS, about initializer_range (0.02)
        # at the start, so AdamW's rate divided by it gives steps of AdamW's size (0.05 for 1e-3)
        lr = args.lr / getattr(model.config, "initializer_range", 0.02)
        optimizer = torch.optim.Adafactor(model.parameters(), lr=lr)
    elif args.optim == "muon":
        # Muon orthogonalises each update of a 2-D matrix, so it takes the hidden layers'
        # matrices only. "match_rms_adamw" scales its update to AdamW's size, so both take
        # AdamW's learning rate.
        muon, rest = muon_split(model)
        optimizer = MuonAndAdamW(
            muon=torch.optim.Muon(muon, lr=args.lr, weight_decay=0.01,
                                  adjust_lr_fn="match_rms_adamw"),
            adamw=torch.optim.AdamW(rest, lr=args.lr),
        )  # fmt: skip
    else:
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise SystemExit("optimizers.py needs bitsandbytes: pip install bitsandbytes") from None
        # Embeddings keep 32-bit state, as the Trainer arranges for optim="adamw_bnb_8bit" and
        # bitsandbytes' own Embedding modules do: a batch holds few of the vocabulary's tokens,
        # so an embedding's gradient rows swing between zero and large values, and the paper
        # behind these optimizers (Dettmers et al., "8-bit Optimizers via Block-wise
        # Quantization") names that uneven token distribution as a source of instability.
        # The override is read at the optimizer's first step.
        manager = bnb.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
        # tensors under 4096 values (the norms' weights) keep 32-bit state too: min_8bit_size
        if args.optim == "adamw8bit":
            optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=args.lr)
        else:  # Lion: the sign of a blend of its one moment and the gradient, so every entry
            # moves by lr; its authors advise a rate 3-10x smaller than AdamW's (Chen et al. 2023,
            # "Symbolic Discovery of Optimization Algorithms", section 5,
            # https://arxiv.org/abs/2302.06675)
            bits = 32 if args.optim == "lion" else 8
            optimizer = bnb.optim.Lion(model.parameters(), lr=args.lr / 3, optim_bits=bits)
    # <<<
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
