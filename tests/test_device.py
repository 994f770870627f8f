"""The CUDA paths, run against fake cards (tests/fake_gpu.py): every finding of the GPU review.

Each test names the defect it guards against; each would fail on the code before the fix.
"""

import io
import json
import re
import time
import tokenize
import warnings
from pathlib import Path

import pytest
import torch

from helpers import device as dev
from helpers.hardware import hardware_report, precision_problem
from helpers.lessons.sdpa_flash_attention import attention_dtype, backend_problem
from helpers.memory import memory_budget
from helpers.timing import flops_utilisation, peak_tflops
from tests.fake_gpu import PROFILES, FakeGpu

ROOT = Path(__file__).resolve().parents[1]
GiB, MiB = 2**30, 2**20


@pytest.fixture
def fp32_precision():
    """Put torch's fp32 precision settings back as they were (they are process-wide)."""
    names = ("matmul", "conv")
    before = (torch.backends.fp32_precision, *(_tf32_setting(n) for n in names))
    yield
    torch.backends.fp32_precision = before[0]
    torch.backends.cuda.matmul.fp32_precision = before[1]
    torch.backends.cudnn.conv.fp32_precision = before[2]
    torch.backends.mkldnn.matmul.fp32_precision = "none"
    torch.backends.mkldnn.conv.fp32_precision = "none"


@pytest.fixture
def transformers_tf32_cache():
    """transformers answers "tf32 here?" and sets it once per process (lru_cache): forget it."""
    from transformers.utils import import_utils

    caches = (import_utils.enable_tf32, import_utils.is_torch_tf32_available)
    for fn in caches:
        fn.cache_clear()
    yield
    for fn in caches:
        fn.cache_clear()


def _tf32_setting(name: str) -> str:
    return (
        torch.backends.cuda.matmul if name == "matmul" else torch.backends.cudnn.conv
    ).fp32_precision


# -- 1. devices carry an index; the budget works on CUDA --------------------------------------


def test_the_fakes_apply_torchs_own_index_rule(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["h100"]])
    # What the course did before: the accelerator's device, which has no index.
    indexless = torch.accelerator.current_accelerator()
    assert indexless == torch.device("cuda") and indexless.index is None
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_per_process_memory_fraction(0.5, indexless)
    with pytest.raises(TypeError, match="float"):
        torch.cuda.set_per_process_memory_fraction(1, torch.device("cuda", 0))


def test_default_device_carries_an_index(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["h100"], PROFILES["a100-80"]])
    monkeypatch.delenv(dev.DEVICE_ENV, raising=False)
    assert dev.default_device() == torch.device("cuda", 0)
    monkeypatch.setenv(dev.DEVICE_ENV, "cuda")
    assert dev.default_device() == torch.device("cuda", 0)
    monkeypatch.setenv(dev.DEVICE_ENV, "cuda:1")
    assert dev.default_device() == torch.device("cuda", 1)
    assert dev.resolve("cpu") == torch.device("cpu")


def test_memory_budget_caps_the_allocator_with_the_default_device(monkeypatch):
    gpu = FakeGpu(monkeypatch, [PROFILES["h100"]])
    total = PROFILES["h100"].total_memory
    with memory_budget(16 * GiB) as cap:  # the device comes from default_device()
        assert gpu.fraction == pytest.approx((16 * GiB - dev.ASSUMED_CONTEXT) / total)
        assert cap.allocator_limit == 16 * GiB - dev.ASSUMED_CONTEXT
        assert cap.context_source == "assumed" and not cap.clamped
        gpu.allocate(10 * GiB)
        with pytest.raises(torch.OutOfMemoryError):
            gpu.allocate(6 * GiB)  # 16 GiB reserved + the context would not fit 16 GiB
        gpu.free(10 * GiB)
    assert gpu.fraction == 1.0  # lifted afterwards
    assert gpu.events[-2:] == ["empty cache", "reset peaks"]


# -- 9. the budget emulates a real card: the context is inside it -------------------------------


def test_cap_subtracts_this_process_context_measured_by_nvml(monkeypatch):
    gpu = FakeGpu(monkeypatch, [PROFILES["a100-80"]], context=600 * MiB)
    gpu.allocate(2 * GiB)  # the process has a context and a reserve: NVML lists it
    cap = dev.cap_allocator(torch.device("cuda", 0), 16 * GiB)
    assert cap.context == 600 * MiB and cap.context_source == "NVML"
    assert cap.allocator_limit == 16 * GiB - 600 * MiB


@pytest.mark.parametrize("refusal", ["no-permission", "not-supported"])
def test_a_refused_process_list_falls_back_to_the_assumed_context(monkeypatch, refusal):
    # Containers and virtual GPUs often refuse nvmlDeviceGetComputeRunningProcesses: the cap
    # (and every budgeted experiment) must still work, with the context assumed and said why.
    gpu = FakeGpu(monkeypatch, [PROFILES["h100"]], processes=refusal)
    gpu.allocate(2 * GiB)
    cap = dev.cap_allocator(torch.device("cuda", 0), 16 * GiB)
    assert cap.context == dev.ASSUMED_CONTEXT and cap.context_source == "assumed"
    assert "refused the process list" in cap.context_why
    assert "assumed: NVML refused the process list" in cap.describe_context()
    assert cap.allocator_limit == 16 * GiB - dev.ASSUMED_CONTEXT
    with memory_budget(16 * GiB) as capped:  # what every budgeted experiment goes through
        assert capped.context_source == "assumed"
    assert gpu.fraction == 1.0


def test_the_context_is_assumed_and_said_why_without_nvml(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["t4"]], nvml="absent")
    cap = dev.cap_allocator(torch.device("cuda", 0), 8 * GiB)
    assert cap.context_source == "assumed" and "nvidia-ml-py is not installed" in cap.context_why


def test_the_context_is_assumed_while_nvml_does_not_list_this_process(monkeypatch):
    gpu = FakeGpu(monkeypatch, [PROFILES["t4"]])  # NVML works, but lists no process of ours yet
    cap = dev.cap_allocator(torch.device("cuda", 0), 8 * GiB)
    assert cap.context_source == "assumed" and "does not list this process" in cap.context_why
    gpu.allocate(GiB)
    assert dev.cap_allocator(torch.device("cuda", 0), 8 * GiB).context_why == ""


def test_a_budget_larger_than_the_card_is_the_whole_card(monkeypatch):
    gpu = FakeGpu(monkeypatch, [PROFILES["t4"]])
    cap = dev.cap_allocator(torch.device("cuda", 0), 16 * GiB)
    t4 = PROFILES["t4"].total_memory
    assert cap.clamped and cap.allocator_limit == t4 - dev.ASSUMED_CONTEXT
    assert gpu.fraction == pytest.approx(cap.allocator_limit / t4)
    with pytest.raises(ValueError, match="nothing beside the CUDA context"):
        dev.cap_allocator(torch.device("cuda", 0), 100 * MiB)


# -- 3. bf16: native only -----------------------------------------------------------------------


@pytest.mark.parametrize("card", ["t4", "v100"])
def test_bf16_is_not_offered_where_it_is_only_emulated(monkeypatch, card):
    FakeGpu(monkeypatch, [PROFILES[card]])
    cuda = torch.device("cuda", 0)
    assert torch.cuda.is_bf16_supported()  # torch's default counts emulation: True here
    assert not torch.cuda.is_bf16_supported(including_emulation=False)
    assert not dev.bf16_native(cuda)
    report = hardware_report(cuda)
    assert not report.bf16 and report.fp16 and not report.tf32
    problem = precision_problem("bf16", cuda)
    assert problem and "fp16" in problem and "emulate" in problem
    assert precision_problem("fp16", cuda) is None
    assert attention_dtype(cuda) == torch.float16  # flash/efficient refuse bf16 below sm80


@pytest.mark.parametrize("card", ["a10g", "l4", "a100-40", "h100", "a100-mig"])
def test_bf16_and_tf32_from_ampere_on(monkeypatch, card):
    FakeGpu(monkeypatch, [PROFILES[card]])
    cuda = torch.device("cuda", 0)
    report = hardware_report(cuda)
    assert report.bf16 and report.tf32
    assert precision_problem("bf16", cuda) is None and precision_problem("tf32", cuda) is None
    assert attention_dtype(cuda) == torch.bfloat16
    assert report.mig == (card == "a100-mig")
    assert report.multiprocessors == PROFILES[card].multiprocessors


# -- 4. NVML: matched by UUID, degrading with a reason -------------------------------------------


def test_nvml_follows_cuda_visible_devices_given_as_a_uuid(monkeypatch):
    t4, h100 = PROFILES["t4"], PROFILES["h100"]
    FakeGpu(monkeypatch, [t4, h100], visible=f"GPU-{h100.uuid}")
    cuda = torch.device("cuda", 0)
    assert dev.gpu_info(cuda).name == h100.name
    # NVML's index 0 is the T4: matching by index would have reported the wrong card.
    assert h100.name in dev.nvml_summary(cuda)


def test_nvml_follows_a_reordered_visible_list(monkeypatch):
    t4, h100 = PROFILES["t4"], PROFILES["h100"]
    gpu = FakeGpu(monkeypatch, [t4, h100], visible="1,0")
    assert h100.name in dev.nvml_summary(torch.device("cuda", 0))
    assert t4.name in dev.nvml_summary(torch.device("cuda", 1))
    gpu.allocate(GiB, index=1)
    assert dev.nvml_used_bytes(torch.device("cuda", 1)) == GiB + gpu.context
    assert dev.nvml_used_bytes(torch.device("cuda", 0)) == 0


def test_nvml_finds_a_mig_slice_by_its_own_uuid(monkeypatch):
    mig = PROFILES["a100-mig"]
    gpu = FakeGpu(monkeypatch, [mig])
    cuda = torch.device("cuda", 0)
    assert mig.name in dev.nvml_summary(cuda)
    gpu.allocate(GiB)
    assert dev.nvml_used_bytes(cuda) == GiB + gpu.context  # the slice's, not the parent's


def test_a_mig_slice_with_its_parents_uuid_is_not_mistaken_for_the_parent(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["a100-mig"]], mig_reports_parent_uuid=True)
    cuda = torch.device("cuda", 0)
    summary = dev.nvml_summary(cuda)
    assert summary.startswith("NVML view unavailable") and "MIG" in summary
    assert dev.nvml_used_bytes(cuda) is None


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("no-permission", "Insufficient Permissions"),
        ("missing", "no NVIDIA driver"),
        ("absent", "not installed"),
    ],
)
def test_nvml_errors_degrade_to_a_reason(monkeypatch, mode, says):
    FakeGpu(monkeypatch, [PROFILES["a100-80"]], nvml=mode)
    cuda = torch.device("cuda", 0)
    report = hardware_report(cuda)  # must not raise
    assert report.nvml.startswith("NVML view unavailable") and says in report.nvml
    assert dev.nvml_used_bytes(cuda) is None
    sampler = _sample(cuda)
    assert sampler.mean is None and says in sampler.problem


def _sample(device):
    with dev.UtilSampler(device, every=0.001) as sampler:
        time.sleep(0.05)
    return sampler


def test_util_sampler_reads_the_matched_device(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["l4"]])
    sampler = _sample(torch.device("cuda", 0))
    assert sampler.mean == 97 and sampler.problem is None


def test_util_sampler_says_why_a_mig_slice_has_no_utilisation(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["a100-mig"]])
    sampler = _sample(torch.device("cuda", 0))
    assert sampler.mean is None and "Not Supported" in sampler.problem


def test_no_nvml_view_on_the_cpu():
    assert dev.nvml_used_bytes(torch.device("cpu")) is None
    assert dev.nvml_summary(torch.device("cpu")).startswith("NVML view unavailable")


# -- 5. TF32 through PyTorch's fp32_precision API -------------------------------------------------


def test_set_tf32_uses_the_new_api_and_leaves_the_trainer_in_charge(
    monkeypatch, fp32_precision, transformers_tf32_cache
):
    from transformers import TrainingArguments

    FakeGpu(monkeypatch, [PROFILES["a100-80"]])
    dev.set_tf32(True)
    assert dev.tf32_matmul() == "tf32"
    dev.set_tf32(False)
    assert dev.tf32_matmul() == "ieee"
    # An explicit setting shadows the global one that transformers' enable_tf32 sets: the
    # Trainer's tf32=True would not reach the matmuls (what lesson 05 did with the legacy
    # set_float32_matmul_precision("highest")) ...
    torch.backends.fp32_precision = "tf32"
    assert dev.tf32_matmul() == "ieee"
    # ... until the course hands the choice back.
    torch.backends.fp32_precision = "ieee"
    dev.set_tf32(None)
    TrainingArguments(output_dir="unused", tf32=True, use_cpu=True, report_to="none")
    assert dev.tf32_matmul() == "tf32"


def test_tf32_is_refused_below_ampere(monkeypatch, transformers_tf32_cache):
    from transformers import TrainingArguments

    FakeGpu(monkeypatch, [PROFILES["t4"]])
    with pytest.raises(ValueError, match="Ampere"):
        TrainingArguments(output_dir="unused", tf32=True, use_cpu=True, report_to="none")
    assert precision_problem("tf32", torch.device("cuda", 0))


# -- 12. MFU: exact names, MIG slices scaled, HFU named ------------------------------------------


def test_peak_table_matches_exact_names():
    assert peak_tflops("NVIDIA L40", "bf16") == 181.0  # not the L4's 121 by substring
    assert peak_tflops("NVIDIA L4", "bf16") == 121.0
    assert peak_tflops("NVIDIA L40S", "bf16") == 362.0
    assert peak_tflops("Tesla T4", "bf16") is None  # no bf16 tensor cores
    assert peak_tflops("NVIDIA GeForce RTX 4090", "bf16") is None  # not in the table: no guess


def test_a_mig_slice_gets_its_share_of_the_peak_or_none():
    name = PROFILES["a100-mig"].name
    assert peak_tflops(name, "bf16") is None  # the whole GPU's peak would be 7x too high
    assert peak_tflops(name, "bf16", multiprocessors=14) == pytest.approx(312.0 * 14 / 108)


def test_checkpointing_makes_the_ratio_hfu_not_mfu():
    seconds = 1.0
    flops = int(0.5 * 989e12)  # half the H100's bf16 peak in one second
    model, hardware = flops_utilisation(flops, seconds, "NVIDIA H100 80GB HBM3", "bf16")
    assert model == hardware == pytest.approx(0.5)
    model, hardware = flops_utilisation(
        flops, seconds, "NVIDIA H100 80GB HBM3", "bf16", recomputes=True
    )
    assert model is None and hardware == pytest.approx(0.5)


# -- 13. SDPA's refusal reasons are kept ---------------------------------------------------------


def test_backend_problem_keeps_the_reasons_cuda_gives(monkeypatch):
    def refuse(name, q, k, v, causal=True):
        # What CUDA's select_sdp_backend does when no allowed kernel fits (sdp_utils.cpp):
        # a header per kernel, one warning per reason, then a generic error.
        warnings.warn("Memory efficient kernel not used because:", stacklevel=1)
        warnings.warn("We are not enabling memory efficient attention because ...", stacklevel=1)
        warnings.warn("Flash attention kernel not used because:", stacklevel=1)
        warnings.warn(
            "Flash attention only supports gpu architectures in the range [sm80, sm121]. "
            "Attempting to run on a sm 7.5 gpu.",
            stacklevel=1,
        )
        warnings.warn(
            "Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query "
            "dtype: float, Key dtype: float, and Value dtype: float instead.",
            stacklevel=1,
        )
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr("helpers.lessons.sdpa_flash_attention.attend", refuse)
    problem = backend_problem("sdpa-flash")
    assert problem.startswith("No available kernel")
    assert "sm 7.5" in problem and "dtype: {Half, BFloat16}" in problem
    assert "memory efficient" not in problem  # another kernel's reasons are left out


def test_backend_problem_is_none_where_the_kernel_runs():
    assert backend_problem("sdpa-math") is None


# -- 11. the timed steps never pay the allocator's refill --------------------------------------


def test_a_step_runs_between_the_peak_reset_and_the_timing(monkeypatch):
    from helpers import train
    from helpers.timing import time_fn

    events = []
    real_step = train.Trainee.step

    def step(self):
        events.append("step")
        return real_step(self)

    def reset(device):
        events.append("reset")

    def timed(fn, device, warmup=1, repeats=5):
        events.append(f"time_fn warmup={warmup}")
        return time_fn(fn, device, warmup=warmup, repeats=repeats)

    monkeypatch.setattr(train.Trainee, "step", step)
    monkeypatch.setattr(train, "reset_device_peaks", reset)
    monkeypatch.setattr(train, "time_fn", timed)
    train.measure(train.RunConfig(repeats=2, flops=False))
    after = events[events.index("reset") + 1 :]
    assert after[0] == "time_fn warmup=1" and after[1:] == ["step"] * 3  # 1 untimed + 2


# -- One home for the GPU surface -------------------------------------------------------------


def _code_tokens(text: str) -> str:
    """The code without comments and strings (they may name the APIs they stand in for)."""
    skip = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    lines = [line for line in text.splitlines() if not line.lstrip().startswith(("%", "!"))]
    tokens = tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline)
    return " ".join(t.string for t in tokens if t.type not in skip).replace(" . ", ".")


# The CUDA calls a lesson teaches in its own cells (the learner's code, shown as PyTorch's API):
# lesson 00 the peak everyone quotes, lesson 15 the memory snapshot and a real out-of-memory
# error under a cap, lesson 16 where pinned memory applies. Everything else goes through
# helpers.device.
TAUGHT = {
    "00_setup_and_measuring.ipynb": {
        "torch.accelerator.reset_peak_memory_stats", "torch.accelerator.memory_allocated",
        "torch.accelerator.max_memory_allocated",
    },
    "15_seeing_memory.ipynb": {
        "torch.cuda.memory._record_memory_history", "torch.cuda.memory._dump_snapshot",
        "torch.cuda.set_per_process_memory_fraction", "torch.cuda.get_device_properties",
        "torch.cuda.memory_allocated", "torch.cuda.max_memory_allocated",
        "torch.cuda.reset_peak_memory_stats", "torch.cuda.empty_cache",
        "torch.cuda.memory_summary", "torch._C._cuda_attach_out_of_memory_observer",
    },
    "16_more_memory.ipynb": {"torch.cuda.is_available"},
}  # fmt: skip


def test_only_helpers_device_touches_cuda_accelerator_or_nvml():
    pattern = re.compile(
        r"torch\.cuda\.[\w.]+|torch\.accelerator\.[\w.]+|torch\.backends\.cud[\w.]*|import pynvml"
    )
    code = {
        p: p.read_text()
        for folder in ("helpers", "helpers/course", "scripts")
        for p in (ROOT / folder).glob("*.py")
    }
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(path.read_text())["cells"]
        code[path] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    offenders = [
        f"{path.relative_to(ROOT)}: {match}"
        for path, text in code.items()
        if path.name != "device.py"
        for match in pattern.findall(_code_tokens(text))
        if match not in TAUGHT.get(path.name, ())
    ]
    assert not offenders, "\n".join(offenders)


def test_the_cuda_calls_a_lesson_teaches_are_still_in_it():
    for name, calls in TAUGHT.items():
        cells = json.loads((ROOT / "notebooks" / name).read_text())["cells"]
        text = _code_tokens(
            "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        )
        assert not [c for c in calls if c not in text], (
            f"{name} no longer calls them: update TAUGHT"
        )


# -- 10. the planner on CUDA: a margin for the allocator, measured inside the cap ---------------


def test_planner_leaves_room_for_the_context_and_the_allocator_on_cuda(monkeypatch):
    from helpers.planner import candidates, usable_budget

    FakeGpu(monkeypatch, [PROFILES["a100-80"]])
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    budget = 16 * GiB
    assert usable_budget(budget, cpu) == budget
    assert usable_budget(budget, cuda) == int((budget - dev.ASSUMED_CONTEXT) / 1.1)
    # A budget just above one candidate's estimated peak: it fits on a CPU, not on CUDA.
    space = {"precisions": ["fp32"], "optimizers": ["adamw"], "attentions": ["eager"]}
    probe = candidates("bert-large", 64 * GiB, 4, 512, cuda, checkpointing=(False,), **space)
    peak = next(c for c in probe if c.micro_batch == 4).estimated_peak
    # (the stage model's settings: the traced ones build a model, which seeds the fake GPU)
    on_cuda = candidates("bert-large", int(1.02 * peak), 4, 512, cuda, checkpointing=(False, True),
                         **space)  # fmt: skip
    assert not next(c for c in on_cuda if c.micro_batch == 4 and c.activations == "none").fits


def test_planner_builds_and_measures_inside_the_cap(monkeypatch):
    from helpers import train
    from helpers.planner import _run

    gpu = FakeGpu(monkeypatch, [PROFILES["l4"]])
    seen = []

    class Trainee:  # stands in for helpers.train.Trainee: records the cap at each moment
        def __init__(self, cfg):
            seen.append(("build", gpu.fraction))
            self.device = dev.resolve(cfg.device)
            self.model = torch.nn.Linear(2, 2)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

        def step(self):
            seen.append(("step", gpu.fraction))

    monkeypatch.setattr(train, "Trainee", Trainee)
    _run(train.RunConfig(device="cuda", warmup=1), 8 * GiB)
    assert [what for what, _ in seen] == ["build", "step", "step"]  # warm-up, tracked
    assert all(fraction < 0.4 for _, fraction in seen), seen  # 8 GiB of a 22 GiB card
    assert gpu.fraction == 1.0  # and lifted afterwards


# -- 7. the allocator's view of one computation, from a baseline after a warm-up ---------------


def test_allocator_growth_leaves_out_inputs_and_what_a_warm_up_left(monkeypatch):
    from helpers.memory import allocator_baseline, allocator_growth

    gpu = FakeGpu(monkeypatch, [PROFILES["h100"]])
    cuda = torch.device("cuda", 0)
    workspace, scratch = 32 * MiB, 10 * MiB

    def attention_call(first: bool) -> None:
        if first:  # cuBLAS allocates its workspace at the first matmul and keeps it
            gpu.allocate(workspace)
        gpu.allocate(scratch)
        gpu.free(scratch)

    gpu.allocate(100 * MiB)  # q, k, v made before the measurement
    attention_call(first=True)  # the warm-up call layer_memory makes
    baseline = allocator_baseline(cuda)
    attention_call(first=False)
    assert allocator_growth(cuda, baseline) == scratch
    # Measured the old way (peak after a reset, no warm-up) the first call would have
    # counted the inputs and the workspace as well: a constant that bends a fitted slope.
    assert allocator_baseline(torch.device("cpu")) is None


# -- The remaining CUDA branches of helpers, under the fakes ------------------------------------


def test_present_and_set_current(monkeypatch):
    gpu = FakeGpu(monkeypatch, [PROFILES["a100-80"], PROFILES["a100-80"]])
    assert dev.present(torch.device("cuda", 1)) and not dev.present(torch.device("cuda", 2))
    assert dev.present(torch.device("cpu")) and not dev.present(torch.device("mps"))
    dev.set_current(torch.device("cuda", 1))
    assert gpu.current == 1 and dev.resolve("cuda") == torch.device("cuda", 1)


def test_flash_attention_2_needs_ampere_and_the_package(monkeypatch):
    from helpers.lessons.sdpa_flash_attention import flash_attn_2_problem

    FakeGpu(monkeypatch, [PROFILES["t4"], PROFILES["h100"]])
    assert "8.0" in flash_attn_2_problem(torch.device("cuda", 0))
    problem = flash_attn_2_problem(torch.device("cuda", 1))  # the package is not installed here
    assert problem is None or "flash-attn" in problem


def test_the_fork_server_preloads_no_cuda_asking_module_on_a_gpu(monkeypatch):
    from helpers.forkserver import PRELOAD_CUDA, preload_list

    FakeGpu(monkeypatch, [PROFILES["l4"]])
    assert preload_list("bitsandbytes", "peft") == PRELOAD_CUDA  # children import them
