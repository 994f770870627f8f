"""helpers.quiet: the library notices it names go, everything else stays."""

import subprocess
import sys
import warnings

import pytest
import torch

from helpers.quiet import (
    DEEPSPEED_LOGGER,
    _cpu_accelerator_notice,
    quiet_libraries,
    silence_library_notices,
)


@pytest.fixture(autouse=True)
def _loud_loggers():
    """Each test starts without the silencing an earlier isolate.start() left in this process."""
    import logging

    ds = logging.getLogger(DEEPSPEED_LOGGER)
    had = _cpu_accelerator_notice in ds.filters
    ds.removeFilter(_cpu_accelerator_notice)
    yield
    if had:
        ds.addFilter(_cpu_accelerator_notice)


def test_quiet_libraries_drops_two_notices_only_and_restores():
    import logging

    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    deepspeed = logging.getLogger("DeepSpeed")
    before = bnb.level

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("DeepSpeed", logging.WARNING, "x.py", 1, msg, None, None)

    with quiet_libraries():
        assert not bnb.isEnabledFor(logging.WARNING)  # the Hub-kernel warning's level
        assert bnb.isEnabledFor(logging.ERROR)  # real errors still show
        assert not deepspeed.filter(record("Setting accelerator to CPU. If you have GPU ..."))
        assert deepspeed.filter(record("something else"))
    assert bnb.level == before
    assert deepspeed.filter(record("Setting accelerator to CPU."))  # filter removed


@pytest.mark.skipif(torch.cuda.is_available(), reason="deepspeed finds the GPU and stays quiet")
def test_tqdms_widget_notice_is_dropped_until_restored():
    # What a kernel without ipywidgets shows when transformers imports tqdm.auto.
    from tqdm import TqdmWarning

    notice = "IProgress not found. Please update jupyter and ipywidgets. See https://..."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        restore = silence_library_notices()
        warnings.warn(notice, TqdmWarning, stacklevel=1)
        warnings.warn("another tqdm warning", TqdmWarning, stacklevel=1)
        restore()
        warnings.warn(notice, TqdmWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["another tqdm warning", notice]


def test_deepspeed_accelerator_warning_is_silenced():
    # The import that a Trainer's creation triggers, in a fresh interpreter (deepspeed warns
    # once per process), with and without the filter: the control shows the check can fail.
    pytest.importorskip("deepspeed")
    code = "from helpers.quiet import quiet_libraries\nwith {}:\n    import deepspeed\n"
    warning = "Setting accelerator to CPU"
    quiet = subprocess.run([sys.executable, "-c", code.format("quiet_libraries()")],
                           capture_output=True, text=True, check=True)  # fmt: skip
    loud = subprocess.run([sys.executable, "-c", code.format("open('/dev/null')")],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert warning in loud.stdout + loud.stderr
    assert warning not in quiet.stdout + quiet.stderr


def _deepspeed_notice_shows() -> bool:
    import logging

    notice = "Setting accelerator to CPU"
    record = logging.LogRecord("DeepSpeed", logging.WARNING, "x.py", 1, notice, None, None)
    return bool(logging.getLogger("DeepSpeed").filter(record))


def test_isolated_experiments_run_inside_it():
    from helpers.isolate import call_isolated

    assert _deepspeed_notice_shows()  # here, outside: the notice would show
    assert call_isolated(_deepspeed_notice_shows).value is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="bitsandbytes' CPU backend is not loaded")
def test_the_fork_server_imports_quietly():
    # The fork server imports helpers._fork_server first, then the libraries (peft pulls in
    # bitsandbytes). In a fresh interpreter, as the server: with and without it first.
    pytest.importorskip("bitsandbytes")
    from helpers.forkserver import preload_list

    assert preload_list("peft")[0] == "helpers._fork_server"
    runs = {
        first: subprocess.run(
            [sys.executable, "-c", f"{first}import bitsandbytes"],
            capture_output=True,
            text=True,
            check=True,
        )
        for first in ("", "import helpers._fork_server; ")
    }
    loud, quiet = (r.stdout + r.stderr for r in runs.values())
    if "kernels-community" not in loud:
        pytest.skip("this CPU's bitsandbytes backend does not look for the Hub kernel")
    assert "kernels-community" not in quiet


def test_isolate_start_silences_this_process_too():
    from helpers import isolate

    assert _deepspeed_notice_shows()
    isolate.start()  # a notebook's first cell
    assert not _deepspeed_notice_shows()


def test_torchao_kernel_and_pytree_enum_notices_are_silenced_in_a_fresh_process():
    # transformers imports torchao when it builds a model; on a CPU build of torch, torchao
    # says it failed to load its CUDA kernels and torch logs a deprecation per enum. A fresh
    # interpreter with and without the silencing: the control shows the check can fail.
    pytest.importorskip("torchao")
    code = (
        "from helpers.quiet import silence_library_notices\n{}\n"
        "import transformers.quantizers.auto\n"
    )
    loud = subprocess.run([sys.executable, "-c", code.format("pass")],
                          capture_output=True, text=True, check=True)  # fmt: skip
    quiet = subprocess.run([sys.executable, "-c", code.format("silence_library_notices()")],
                           capture_output=True, text=True, check=True)  # fmt: skip
    if torch.cuda.is_available():
        pytest.skip("a CUDA build of torch loads torchao's kernels: no notice to silence")
    assert "Failed to load" in loud.stderr and "Enum subclass" in loud.stderr
    assert "Failed to load" not in quiet.stderr and "Enum subclass" not in quiet.stderr
    assert quiet.stderr.strip() == "", quiet.stderr


def test_the_fork_server_asks_nvml_not_cuda_whether_cuda_is_available():
    # torch's fork-safe availability check, set by the module the fork server imports first.
    code = "import os, helpers._fork_server\nprint(os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'])"
    env = {
        k: v for k, v in __import__("os").environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"
    }
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env=env)  # fmt: skip
    assert done.stdout.strip() == "1"
