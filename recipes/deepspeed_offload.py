"""DeepSpeed ZeRO with CPU offload (lesson 08): the optimizer state, its fp32 copy of the
weights and the gradients live in CPU RAM (ZeRO-2, the default); --stage 3 moves the weights too.

The GPU keeps the weights (ZeRO-2: 4 of fp32 AdamW's 16 bytes per parameter) or only the layers
being computed (ZeRO-3), plus activations and gradient buckets. Each step streams gradients to
the host, runs Adam there (DeepSpeedCPUAdam, a vectorised C++ kernel compiled on first use, a
minute or two) and copies the weights back, so steps are slower: use it when the model does not
fit ("Methods and tools for efficient training on a single GPU", section "DeepSpeed ZeRO", and
DeepSpeed's "ZeRO-Offload" tutorial, https://www.deepspeed.ai/tutorials/zero-offload/). On a
CPU, "offload" copies within the same RAM: the run checks the wiring, not the savings. In the
Trainer: `TrainingArguments(deepspeed=ds_config)` with the same dict.

    deepspeed --num_gpus 1 recipes/deepspeed_offload.py --size 1b --seq-len 1024 --stage 3
    python recipes/deepspeed_offload.py --size 1b --seq-len 1024   # one GPU, no launcher
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
    # >>> DeepSpeed: the ZeRO stage; the deepspeed launcher adds --local_rank to the command
    p.add_argument("--stage", type=int, choices=(2, 3), default=2)
    p.add_argument("--optimizer", choices=("cpu_adam", "torch"), help="default: cpu_adam on a GPU")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
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
    # >>> DeepSpeed: without its launcher this process is a world of one, so it sets the
    # variables torch.distributed reads (port 0: any free one). DS_ACCELERATOR makes DeepSpeed
    # use --device. The model is built on the CPU: initialize() moves or partitions it.
    import os
    import sys

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "DS_ACCELERATOR": device.type}  # fmt: skip
    for name, value in env.items():
        os.environ.setdefault(name, value)
    try:
        import deepspeed
    except ImportError:
        sys.exit("deepspeed_offload.py needs deepspeed: pip install deepspeed")
    if device.type == "cpu" and os.environ["WORLD_SIZE"] == "1":
        # Skips the C++ build (a minute or more) of a shared-memory all-reduce for CPU peers.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    model = build_model(args, torch.device("cpu"))
    # <<<
    data = CopyTask(args.batch_size * args.steps, args.seq_len, model.config.vocab_size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    # >>> DeepSpeed: ZeRO offloads the optimizer state, the fp32 weights and the gradients to
    # CPU RAM (stage 3: the weights as well). With offload, the config's "optimizer" section
    # makes DeepSpeedCPUAdam, which steps the host copies fast but compiles a C++ kernel the
    # first time (a minute or two); --optimizer torch steps torch's AdamW there instead (the
    # default on a CPU, where the run checks the wiring, not the speed). fp32 as the base; on
    # a GPU add "bf16": {"enabled": True}. The engine wraps the model, owns backward and step.
    zero = {"stage": args.stage, "offload_optimizer": {"device": "cpu"}}
    if args.stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    ds_config = {"train_micro_batch_size_per_gpu": args.batch_size, "zero_optimization": zero}
    optimizer = None
    if (args.optimizer or ("torch" if device.type == "cpu" else "cpu_adam")) == "cpu_adam":
        ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}}
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        ds_config["zero_force_ds_cpu_optimizer"] = False  # allow a client optimizer on offload
    model, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters(), config=ds_config
    )
    device = model.device  # under the launcher, this process's GPU
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
        # >>> DeepSpeed: the engine's backward sends the gradients to the host; its step runs
        # Adam there, copies the weights back and clears the gradients
        model.backward(loss)
        model.step()
        # <<<
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
