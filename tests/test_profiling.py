"""The memory tools a learner keeps (lesson 15): a profiler trace of a step, a CUDA snapshot.

``helpers.profiling.profile_step`` runs for real on a tiny training step on the CPU. The CUDA
memory snapshot (``helpers.device.record_memory_history``) runs against ``tests/fake_gpu.py``:
the fake replaces only the two C functions torch's Python calls
(``torch._C._cuda_record_memory_history``, ``torch._C._cuda_memorySnapshot``), so
``torch.cuda.memory._record_memory_history``, ``_snapshot`` and ``_dump_snapshot`` (which
opens the file and pickles the snapshot) run as they do on a GPU.
"""

from __future__ import annotations

import gzip
import json
import pickle

import pytest
import torch

from helpers import device as dev
from helpers.memory import CategoryTracker
from helpers.profiling import memory_events, profile_step, read_trace, resident_bytes
from helpers.train import RunConfig, Trainee
from tests.fake_gpu import PROFILES, FakeGpu

MiB, GiB = 2**20, 2**30
CUDA0 = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One llama-tiny AdamW step profiled on the CPU, after a step under the course tracker."""
    trainee = Trainee(RunConfig(model="llama-tiny", batch_size=2, seq_len=32))
    trainee.step()  # creates the AdamW state: the next steps are steady-state steps
    tracker = CategoryTracker(device=trainee.device)
    tracker.track_external(trainee.model, trainee.optimizer)
    with tracker:
        trainee.step()
    path = tmp_path_factory.mktemp("trace") / "step.json"
    result = profile_step(trainee.step, trainee.device, path, warmup=1)
    return trainee, tracker.peaks(), result


# -- torch.profiler: the trace file and the operators that allocate ----------------------------


def test_profile_step_writes_a_chrome_trace_with_memory_events(profiled):
    _, _, result = profiled
    assert result.path.exists() and result.device == "cpu"
    trace = json.loads(result.path.read_text())
    events = trace["traceEvents"]
    assert result.n_events == len(events) > 100
    assert any(e.get("cat") == "cpu_op" and e["name"] == "aten::mm" for e in events)
    memory = [e for e in events if e.get("name") == "[memory]"]
    assert len(memory) == result.memory["cpu"].events > 0
    assert {"Bytes", "Total Allocated", "Total Reserved", "Device Type"} <= set(memory[0]["args"])
    track = result.memory["cpu"]
    assert track.allocations + track.frees == track.events and track.peak_reserved == 0
    # The counter track profile_step adds: one point per [memory] event, drawn by Perfetto.
    counters = [e for e in events if e.get("ph") == "C"]
    assert len(counters) == len(memory)
    assert counters[0]["name"] == "[memory] Total Allocated (cpu)"
    # The counters carry MiB to 4 decimals (profiling.py rounds them): equal to half the last.
    peak_mib = max(c["args"]["MiB"] for c in counters)
    assert peak_mib == pytest.approx(track.peak_allocated / MiB, rel=0, abs=0.5e-4)
    # Reading the file again gives the same tracks: the counters are not [memory] events.
    assert memory_events(result.path) == result.memory


def test_top_memory_is_the_operators_that_allocate_most_sorted(profiled):
    _, _, result = profiled
    top = result.top_memory
    assert 0 < len(top) <= 10
    own = [op.self_cpu_bytes for op in top]
    assert own == sorted(own, reverse=True) and own[-1] > 0
    assert "[memory]" not in {op.name for op in top}
    assert top[0].calls >= 1 and top[0].cpu_time_s > 0
    # The table the lesson prints is sorted the same way.
    assert "Self CPU Mem" in result.table and top[0].name in result.table.splitlines()[3]


def test_the_cpu_profilers_peak_is_the_step_without_what_lived_before(profiled):
    """What the largest "Total Allocated" of a CPU trace counts, checked two ways.

    The CPU allocator reports only blocks allocated while memory profiling is on. The
    parameters, buffers and AdamW state were made before the profiler started (the warm-up
    step made the state), so they are missing from it. The gradients are not: the course's
    step ends with ``zero_grad(set_to_none=True)``, which frees them, so the profiled step
    allocates all of them again, and they are all alive together between the end of backward
    and the optimizer step: the peak is at least 4 bytes x n_params (fp32 gradients). And the
    course tracker, which sees every tensor, peaks at the profiler's peak plus the bytes that
    were alive before (``resident_bytes``). ``baseline`` takes out blocks an earlier profiled
    region of this process (another test) left alive.
    """
    trainee, peaks, result = profiled
    track = result.memory["cpu"]
    step_peak = track.peak_allocated - track.baseline
    assert step_peak >= 4 * trainee.n_params
    before = resident_bytes(trainee.model, trainee.optimizer, trainee.device)
    assert before == peaks.params + peaks.buffers + peaks.optimizer_state
    assert step_peak + before == pytest.approx(peaks.peak, rel=0.01)
    assert result.peak_allocated == track.peak_allocated


def test_resident_bytes_counts_each_storage_once_on_its_device():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[1].weight = model[0].weight  # tied weights: one parameter
    model.register_buffer("alias", model[0].bias.detach())  # another tensor, the same storage
    assert resident_bytes(model) == 4 * (64 + 8 + 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    # AdamW: exp_avg and exp_avg_sq (8 B/param) and a 4-byte step counter per tensor.
    assert resident_bytes(model, optimizer) == 3 * 4 * 80 + 3 * 4
    assert resident_bytes(model, optimizer, device="meta") == 0


def test_read_trace_opens_gzip_and_refuses_what_is_not_a_trace(tmp_path):
    event = {"ph": "i", "name": "[memory]", "pid": 1, "tid": 1, "ts": 1.0,
             "args": {"Bytes": 512, "Total Allocated": 1536, "Total Reserved": 2048,
                      "Device Type": 1}}  # fmt: skip
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [event]}, f)
    (track,) = memory_events(path).values()
    assert (track.device_type, track.baseline, track.peak_reserved) == ("cuda", 1024, 2048)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        read_trace(bad)


# -- the CUDA memory snapshot, against the fake card ------------------------------------------


def test_snapshot_enables_dumps_then_disables_and_writes_the_pickle(monkeypatch, tmp_path):
    gpu = FakeGpu(monkeypatch, [PROFILES["t4"]])
    assert dev.memory_snapshot_supported(CUDA0) == (True, "")
    path = tmp_path / "step.pickle"
    with dev.record_memory_history(CUDA0, path, max_entries=1000) as target:
        assert target == path and gpu.history is not None
        gpu.allocate(MiB)
        gpu.allocate(2 * MiB)
        gpu.free(MiB)
    assert gpu.events[0] == "record history all context=all stacks=python max_entries=1000"
    assert gpu.events[1] == "snapshot"
    assert gpu.events[2].startswith("record history None")
    assert len(gpu.events) == 3 and gpu.history is None  # recording is off again
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    actions = [e["action"] for e in snapshot["device_traces"][0]]
    alloc = ["segment_alloc", "alloc"]  # the reserve grows, then the block is handed out
    assert actions == [*alloc, *alloc, "free_requested", "free_completed"]
    assert snapshot["segments"][0]["total_size"] == 3 * MiB


def test_an_oom_inside_the_block_is_dumped_then_raised_again(monkeypatch, tmp_path):
    gpu = FakeGpu(monkeypatch, [PROFILES["t4"]])
    path = tmp_path / "oom.pickle"
    with pytest.raises(torch.OutOfMemoryError), dev.record_memory_history(CUDA0, path):
        gpu.allocate(GiB)
        gpu.allocate(20 * GiB)  # more than a T4 has
    assert [e.split(" ")[0:3] for e in gpu.events] == [
        ["record", "history", "all"], ["snapshot"], ["record", "history", "None"]
    ]  # fmt: skip
    with open(path, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    assert [e["action"] for e in trace] == ["segment_alloc", "alloc", "oom"]
    assert trace[-1]["size"] == 20 * GiB and trace[-1]["device_free"] > 0


def test_recording_stops_even_when_the_snapshot_cannot_be_written(monkeypatch, tmp_path):
    gpu = FakeGpu(monkeypatch, [PROFILES["t4"]])
    with (
        pytest.raises(FileNotFoundError),
        dev.record_memory_history(CUDA0, tmp_path / "missing" / "x.pickle"),
    ):
        gpu.allocate(MiB)
    assert gpu.events[-1].startswith("record history None") and gpu.history is None


def test_the_bindings_checks_run_above_the_fake(monkeypatch, tmp_path):
    gpu = FakeGpu(monkeypatch, [PROFILES["t4"]])
    with (
        pytest.raises(RuntimeError, match="stacks"),
        dev.record_memory_history(CUDA0, tmp_path / "x.pickle", stacks="cpp"),
    ):
        pass
    assert gpu.events == [] and not (tmp_path / "x.pickle").exists()


def test_on_the_cpu_the_guard_says_skipped_and_why(tmp_path):
    path = tmp_path / "step.pickle"
    ok, why = dev.memory_snapshot_supported(torch.device("cpu"), path)
    assert not ok
    assert why == (
        f"skipped: needs a CUDA GPU (this machine runs on cpu); on a GPU this writes {path}, "
        "open it at https://pytorch.org/memory_viz"
    )
    with (
        pytest.raises(dev.MemorySnapshotUnsupported) as err,
        dev.record_memory_history("cpu", path),
    ):
        pytest.fail("the block must not run without a CUDA GPU")
    assert str(err.value) == why and isinstance(err.value, RuntimeError)
    assert not path.exists()
    if not dev.cuda_available():  # asking for CUDA where torch has none says so
        ok, why = dev.memory_snapshot_supported("cuda:0")
        assert not ok and why.startswith(f"skipped: needs a CUDA GPU (torch {torch.__version__}")


def test_the_snapshot_keeps_the_last_max_entries_events(monkeypatch, tmp_path):
    gpu = FakeGpu(monkeypatch, [PROFILES["t4"]])
    with dev.record_memory_history(CUDA0, tmp_path / "x.pickle", max_entries=3):
        for _ in range(4):
            gpu.allocate(MiB)
    with open(tmp_path / "x.pickle", "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    assert [e["action"] for e in trace] == ["alloc", "segment_alloc", "alloc"]
