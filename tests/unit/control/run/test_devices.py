"""The device and kernel choice of `train` (andrea/control/run/devices.py): each rule on plain facts, no GPU needed.

A combination this machine cannot run is one ConfigError line (exit 2 in the CLI, before the run directory is
touched: tests/faults/test_bad_inputs.py runs the real processes); auto picks what runs.
"""

from __future__ import annotations

import pytest

from andrea.control.run import devices
from andrea.config.check import ConfigError
from andrea.control.run.devices import CudaFacts, choose_device, choose_kernels

NO_CUDA_BUILD = CudaFacts(False, None)
NO_GPU_VISIBLE = CudaFacts(False, "12.4")
TWO_H100 = CudaFacts(True, "12.4", ((9, 0), (9, 0)), ("H100", "H100"))
ONE_T4 = CudaFacts(True, "12.4", ((7, 5),), ("Tesla T4",))


@pytest.mark.parametrize("facts", [NO_CUDA_BUILD, NO_GPU_VISIBLE, TWO_H100])
def test_cpu_is_always_cpu_and_auto_is_cuda_exactly_when_a_gpu_is_there(facts):
    assert choose_device("cpu", facts) == "cpu"
    assert choose_device("auto", facts) == ("cuda" if facts.available else "cpu")


@pytest.mark.parametrize("facts,words", [(NO_CUDA_BUILD, "this torch build has no CUDA support"),
                                         (NO_GPU_VISIBLE, "CUDA_VISIBLE_DEVICES")])
def test_cuda_without_a_gpu_is_a_config_error_saying_why(facts, words):
    with pytest.raises(ConfigError) as e:
        choose_device("cuda", facts)
    assert str(e.value).startswith("train.device=cuda but ") and words in str(e.value)
    assert "--device cpu" in str(e.value)


def test_each_torchrun_process_needs_the_gpu_of_its_local_rank():
    assert choose_device("cuda", TWO_H100, local_rank=1, distributed=True) == "cuda"
    for name in ("cuda", "auto"):
        with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 but this machine shows 2 CUDA devices"):
            choose_device(name, TWO_H100, local_rank=2, distributed=True)


@pytest.mark.parametrize("device,capability,triton_error,kernels", [
    ("cpu", None, None, "torch"),  # the interpreter is never a silent choice
    ("cuda", (9, 0), None, "triton"),
    ("cuda", (8, 0), None, "triton"),
    ("cuda", (7, 5), None, "torch"),  # older than the kernels are built for
    ("cuda", (9, 0), "ImportError: No module named 'triton'", "torch"),
])
def test_auto_kernels_are_triton_only_where_triton_runs(device, capability, triton_error, kernels):
    assert choose_kernels("auto", device, capability=capability, triton_error=triton_error) == kernels


def test_torch_kernels_run_anywhere_and_triton_runs_on_cpu_only_in_the_interpreter_asked_for():
    for device, capability in (("cpu", None), ("cuda", (7, 0)), ("cuda", (9, 0))):
        assert choose_kernels("torch", device, capability=capability, triton_error="ImportError: x") == "torch"
    assert choose_kernels("triton", "cpu", interpreter=True) == "triton"
    with pytest.raises(ConfigError) as e:  # a step would take ~1000x the torch path's time: never by accident
        choose_kernels("triton", "cpu")
    assert str(e.value).startswith("train.kernels=triton on a CPU: ") and "use --kernels torch" in str(e.value)
    assert "TRITON_INTERPRET=1" in str(e.value)


def test_triton_kernels_that_cannot_run_are_a_config_error_naming_the_reason():
    with pytest.raises(ConfigError) as e:
        choose_kernels("triton", "cpu", triton_error="ImportError: No module named 'triton'")
    assert str(e.value) == ("train.kernels=triton but Triton cannot be imported (ImportError: No module named "
                            "'triton'): use --kernels torch")
    with pytest.raises(ConfigError) as e:
        choose_kernels("triton", "cuda", capability=(7, 5), device_name="cuda:0 (Tesla T4)")
    assert str(e.value) == ("train.kernels=triton needs a GPU of compute capability 8.0 or newer; cuda:0 (Tesla T4) "
                            "is 7.5: use --kernels torch")


def test_resolve_probes_triton_only_when_it_would_run_and_reads_the_interpreter_from_the_environment(monkeypatch):
    def no_probe():
        raise AssertionError("import triton probed for kernels that do not use it")
    monkeypatch.setattr(devices, "triton_import_error", no_probe)
    assert devices.resolve("auto", "auto", cuda=NO_CUDA_BUILD) == ("cpu", "torch")
    assert devices.resolve("cuda", "torch", cuda=ONE_T4) == ("cuda", "torch")
    monkeypatch.setattr(devices, "triton_import_error", lambda: None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"train.kernels=triton on a CPU"):
        devices.resolve("cpu", "triton", cuda=TWO_H100)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert devices.resolve("cpu", "triton", cuda=TWO_H100) == ("cpu", "triton")
    assert devices.resolve("auto", "auto", cuda=ONE_T4) == ("cuda", "torch")
    assert devices.resolve("cuda", "auto", local_rank=1, distributed=True, cuda=TWO_H100) == ("cuda", "triton")
    with pytest.raises(ConfigError, match=r"cuda:0 \(Tesla T4\) is 7.5"):
        devices.resolve("cuda", "triton", cuda=ONE_T4)
    monkeypatch.setattr(devices, "triton_import_error", lambda: "ImportError: No module named 'triton'")
    with pytest.raises(ConfigError, match=r"Triton cannot be imported \(ImportError: No module named 'triton'\)"):
        devices.resolve("cpu", "triton", cuda=NO_CUDA_BUILD)
    assert devices.resolve("cuda", "auto", cuda=TWO_H100) == ("cuda", "torch")
