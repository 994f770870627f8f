"""Fully sharded data parallel, FSDP2 (lesson 17): N processes, one per GPU, each store 1/N
of every weight, gradient and optimizer state (ZeRO-3 of lesson 08 across GPUs, no offload).

Memory per GPU: 16/N bytes per parameter in fp32 with AdamW, plus the full weights of the layer
being computed (gathered, then freed again: reshard_after_forward) and the activations. Time:
each layer's weights are all-gathered in the forward and again in the backward and its gradients
reduce-scattered, overlapped with compute by prefetching the next layer. `fully_shard` goes on
each decoder layer, then on the root; the optimizer is built afterwards, on the sharded
parameters (DTensors): PyTorch's "torch.distributed.fsdp.fully_shard",
https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html, and tutorial "Getting
Started with Fully Sharded Data Parallel (FSDP2)",
https://docs.pytorch.org/tutorials/intermediate/FSDP_tutorial.html. In the Trainer, under
torchrun: `TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2})`.
`python recipes/fsdp2.py` runs a world of one: it sets torchrun's variables itself. `--bf16`
adds FSDP2's mixed precision (MixedPrecisionPolicy), `--checkpointing` activation
checkpointing, `--save DIR` a distributed checkpoint (torch.distributed.checkpoint).

    torchrun --nproc-per-node 8 recipes/fsdp2.py --size 1b --batch-size 4 --seq-len 1024 --bf16
    torchrun --nproc-per-node 2 recipes/fsdp2.py --device cpu    # two CPU processes, gloo
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
    # >>> FSDP2: mixed precision, activation checkpointing, clipping, a distributed checkpoint
    p.add_argument("--bf16", action="store_true", help="bf16 compute and all-gathers, fp32 shards")
    p.add_argument(
        "--checkpointing", action="store_true", help="recompute each layer's activations"
    )
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--save", help="a folder: save a distributed checkpoint (DCP) after training")
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
    # >>> FSDP2: join the other processes. torchrun sets these variables; run without it, this
    # process is a world of one (port 0: any free port). One GPU per process, by LOCAL_RANK;
    # NCCL between GPUs, gloo between CPU processes.
    import os

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0",
                        "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():  # fmt: skip
        os.environ.setdefault(name, value)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # <<<
    model = build_model(args, device)
    # >>> FSDP2: each process takes a different 1/N of the data (shuffled the same way on all)
    world = torch.distributed.get_world_size()
    data = CopyTask(args.batch_size * args.steps * world, args.seq_len, model.config.vocab_size)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    # Checkpointing first, then sharding (torchtitan's order: activation checkpointing,
    # compile, FSDP), so each unit's recomputation runs on its gathered weights.
    if args.checkpointing:  # transformers 5.2x's name; older ones: gradient_checkpointing_enable
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})
    # Shard each decoder layer (the unit gathered at a time), then the root (embeddings, final
    # norm, head). Every process built the same weights (seed 0); each now keeps 1/N of them,
    # as DTensors. The base's optimizer, made next, must see these sharded parameters.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # public since 2.6

    # --bf16: the shards, gradients and AdamW state stay fp32; each unit is gathered in bf16
    # (half the bytes moved and held) and computes in bf16; gradients are reduced in fp32.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mp = mp if args.bf16 else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    # <<<
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return model, optimizer, loader, device


def train(args, model, optimizer, loader, device):
    """The loop: one optimizer step per batch. Returns each step's seconds, from the end of
    the step before (so the wait for the next batch counts: that is where input stalls hide)."""
    model.train()
    times, start = [], time.perf_counter()
    # >>> FSDP2: a new shuffle each epoch, the same on every process (this loop is one epoch)
    loader.sampler.set_epoch(0)
    # <<<
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        # >>> FSDP2: clip the norm of the whole gradient; the shards are DTensors, so the norm
        # is summed over every process's shards (one all-reduce)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        # <<<
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.item()  # waits for the device, so the step's time is complete
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        # >>> FSDP2: only rank 0 prints (the loss of its own batch)
        if torch.distributed.get_rank() == 0:
            print(f"step {len(times)}  loss {loss:.3f}  {times[-1] * 1e3:.0f} ms")
        # <<<
    return times


def report(args, times, device):
    """Tokens per second after the first step (which also allocates and warms up)."""
    step_s = statistics.median(times[1:] or times)
    tokens = args.batch_size * args.seq_len
    # >>> FSDP2: a step trains every process's batch; rank 0's clock times it (they wait for
    # each other in the collectives)
    tokens *= torch.distributed.get_world_size()
    # <<<
    line = f"{tokens / step_s:,.0f} tokens/s, median step {step_s * 1e3:.0f} ms"
    if device.type == "cuda":
        line += f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated"
    # >>> FSDP2: rank 0 reports (its own GPU's peak)
    if torch.distributed.get_rank() == 0:
        print(line)
    # <<<


def main(argv=None):
    args = parse_args(argv)
    model, optimizer, loader, device = build(args)
    times = train(args, model, optimizer, loader, device)
    report(args, times, device)
    # >>> FSDP2: a distributed checkpoint: every process writes its own shards of the model
    # and optimizer state, in parallel (torch.distributed.checkpoint, "DCP"); dcp.load with
    # set_state_dict reads it back into any number of processes.
    if args.save:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=args.save)
        # every process done writing before any leaves the group (torch 2.11 over gloo aborted
        # one run in three at exit without it)
        torch.distributed.barrier()
    # <<<
    # >>> FSDP2: leave the process group
    torch.distributed.destroy_process_group()
    # <<<


if __name__ == "__main__":
    main()
