"""LoRA (lesson 13): the model's weights are frozen and each adapted Linear layer learns a
low-rank update beside them, y = W x + (alpha / r) B A x, with peft's LoraConfig.

The frozen weights get no gradients and no optimizer state, so those two shrink to the
adapters' size (r x (in + out) per layer); the weights and the activations stay as large as
before, and each step still runs the full forward and backward. `--qlora` also stores the frozen
weights in 4-bit NF4 (bitsandbytes), about a quarter of bf16's bytes (here on CUDA GPUs only);
`--dora` trains a magnitude per output row beside the adapters (DoRA), and each adapted layer
saves two more activations of its output's size for the backward
("Methods and tools for efficient training on a single GPU", section "Using PEFT",
https://huggingface.co/docs/transformers/perf_train_gpu_one; peft's "LoRA" guide,
https://huggingface.co/docs/peft/developer_guides/lora). No TrainingArguments switch: hand the
Trainer the model get_peft_model returns (TRL's SFTTrainer takes `peft_config=`).

    python recipes/lora.py --size 1b --batch-size 4 --seq-len 1024 --lora-r 16 --device cuda
    python recipes/lora.py --qlora --model-path meta-llama/Llama-3.2-1B --seq-len 1024
    python recipes/lora.py --dora
"""

import argparse
import json
import statistics
import time

# >>> LoRA: peft adds the adapters and freezes the rest
import peft

# <<<
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
    # >>> LoRA: the adapters' rank and scale; --qlora stores the frozen weights in 4-bit
    p.add_argument("--lora-r", type=int, default=16, help="adapter rank r")
    p.add_argument("--lora-alpha", type=float, help="adapter scale alpha (default 2 r)")
    p.add_argument("--qlora", action="store_true", help="frozen weights in 4-bit NF4 (CUDA)")
    p.add_argument("--model-path", help="--qlora: a saved or Hub model, used instead of --size")
    p.add_argument("--dora", action="store_true", help="DoRA: also a magnitude per output row")
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
    # >>> LoRA: freeze the weights, add adapters. --qlora: from_config takes no
    # quantization_config, so the weights (random, or --model-path's) are loaded in 4-bit through
    # from_pretrained; prepare_model_for_kbit_training upcasts the unquantized rest (norms,
    # embeddings) to fp32 (its default use_gradient_checkpointing=True would also turn on lesson
    # 04's checkpointing: off here, so the change is the 4-bit weights alone).
    if args.qlora:
        import sys
        import tempfile

        if device.type != "cuda":
            sys.exit(f"needs a CUDA GPU: QLoRA saves GPU memory with CUDA 4-bit kernels ({device})")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            sys.exit("lora.py --qlora needs bitsandbytes: pip install bitsandbytes")
        from transformers import BitsAndBytesConfig

        # QLoRA's settings, none of them the default (fp4, fp32 scales, fp32 compute)
        nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                 bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
        with tempfile.TemporaryDirectory() as folder:
            if not args.model_path:  # the random weights, saved so from_pretrained can load them
                model.to(torch.bfloat16).save_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(
                args.model_path or folder, quantization_config=nf4, device_map=device,
                attn_implementation=args.attn)  # fmt: skip
        model.config.use_cache = False
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model = model.to(device)
    # "all-linear": every Linear but the output layer, on any architecture. peft's default
    # (target_modules=None) looks the model type up in a table (for Llama: q_proj and v_proj
    # only) and fails for a type not in it; the QLoRA paper found that adapting every layer is
    # what matches full fine-tuning.
    lora = peft.LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha or 2 * args.lora_r,
        target_modules="all-linear",
        lora_dropout=0.0,
        use_dora=args.dora,  # DoRA: each output row of W + BA rescaled to a trained length
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(model, lora)
    model.print_trainable_parameters()  # trainable params: ... || all params: ... || trainable%
    return model
    # <<<


def build(args):
    """The model, the optimizer and the data: everything the loop needs."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None: no GPU
    device = torch.device(args.device or accelerator or "cpu")
    model = build_model(args, device)
    data = CopyTask(args.batch_size * args.steps, args.seq_len, model.config.vocab_size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    # >>> LoRA: the optimizer sees only the adapters, so it keeps state for them alone
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr)
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
