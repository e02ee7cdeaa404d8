"""Which device and kernels `train` runs with, decided before anything is written to the run directory.

`train.device` (auto | cpu | cuda) and `train.kernels` (auto | torch | triton) are checked against what this
machine has. A combination it cannot run is a ConfigError (one `andrea: error:` line, exit 2), raised by two
pure functions over plain facts — `choose_device` (CudaFacts: what torch.cuda reports) and `choose_kernels`
(the device's compute capability, the error `import triton` gave) — so every rule is tested without a GPU.
`resolve` gathers those facts and applies them. Triton on a CPU runs only in Triton's interpreter, and only when
the environment asks for it (TRITON_INTERPRET=1, read by the first `import triton`: slow, exact, what the CPU test
suite runs); otherwise `--kernels triton` on a CPU is refused (a step would take ~1000x the torch path's time).
Reads and writes no files.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from andrea.config.check import ConfigError

log = logging.getLogger("andrea.control.run.devices")

MIN_TRITON_CAPABILITY = (8, 0)
"""The oldest GPU the Triton kernels are built and checked for: sm_80, the oldest target of the compile check
(andrea/kernels/compile_check.py); on CUDA they run on bf16 activations (autocast), native from sm_80 on."""


@dataclass(frozen=True)
class CudaFacts:
    """What torch reports about CUDA on this machine (plain data: tests build their own)."""

    available: bool  # torch.cuda.is_available()
    torch_cuda: str | None  # torch.version.cuda: None for a CPU-only build of torch
    capabilities: tuple[tuple[int, int], ...] = ()  # (major, minor) of each visible device, by index
    names: tuple[str, ...] = ()  # each visible device's name, by index


def choose_device(name: str, cuda: CudaFacts, local_rank: int = 0, distributed: bool = False) -> str:
    """"cpu" or "cuda" for train.device=`name`; ConfigError when this machine cannot run it.

    Under torchrun (distributed) each process drives the GPU of its LOCAL_RANK (distributed.World.device), so
    that GPU must be visible."""
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device={name!r} must be auto, cpu or cuda")
    if name == "cpu":
        return "cpu"
    if not cuda.available:
        if name == "auto":
            return "cpu"
        why = ("this torch build has no CUDA support" if cuda.torch_cuda is None
               else f"no CUDA device is available (torch built for CUDA {cuda.torch_cuda}: check the driver "
                    "and CUDA_VISIBLE_DEVICES)")
        raise ConfigError(f"train.device=cuda but {why}: use --device cpu")
    n = len(cuda.capabilities)
    if distributed and local_rank >= n:
        raise ConfigError(f"train.device={name}: LOCAL_RANK={local_rank} but this machine shows {n} CUDA "
                          f"device{'s' if n != 1 else ''}: start at most {n} processes per node "
                          "(torchrun --nproc_per_node)")
    return "cuda"


def choose_kernels(name: str, device: str, *, capability: tuple[int, int] | None = None,
                   device_name: str = "", triton_error: str | None = None, interpreter: bool = False) -> str:
    """"torch" or "triton" for train.kernels=`name` on `device` ("cpu" / "cuda"); ConfigError when it cannot run.

    `capability` is the CUDA device's (major, minor), `triton_error` what `import triton` raised (None: it
    imported), `interpreter` whether TRITON_INTERPRET asks for Triton's interpreter. auto = Triton on a CUDA
    device it is built for, else the plain-torch reference; Triton on a CPU runs only in the interpreter, asked
    for (slow and exact: for tests, never a silent choice)."""
    if name not in ("auto", "torch", "triton"):
        raise ConfigError(f"train.kernels={name!r} must be auto, torch or triton")
    if name == "torch":
        return "torch"
    too_old = device == "cuda" and capability is not None and tuple(capability) < MIN_TRITON_CAPABILITY
    if name == "auto":
        return "triton" if device == "cuda" and triton_error is None and not too_old else "torch"
    if triton_error is not None:
        raise ConfigError(f"train.kernels=triton but Triton cannot be imported ({triton_error}): "
                          "use --kernels torch")
    if device == "cpu" and not interpreter:
        raise ConfigError("train.kernels=triton on a CPU: the Triton kernels need a CUDA GPU (compute capability "
                          "{}.{} or newer); use --kernels torch (TRITON_INTERPRET=1 runs them in Triton's interpreter: "
                          "exact, ~1000x slower, for tests)".format(*MIN_TRITON_CAPABILITY))
    if too_old:
        major, minor = capability
        need = "{}.{}".format(*MIN_TRITON_CAPABILITY)
        raise ConfigError(f"train.kernels=triton needs a GPU of compute capability {need} or newer; "
                          f"{device_name or 'this GPU'} is {major}.{minor}: use --kernels torch")
    return "triton"


def cuda_facts() -> CudaFacts:
    import torch
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    return CudaFacts(available, torch.version.cuda,
                     tuple(torch.cuda.get_device_capability(i) for i in range(count)),
                     tuple(torch.cuda.get_device_name(i) for i in range(count)))


def triton_import_error() -> str | None:
    """None when `import triton` works here; else its error in one line (not installed, or a broken install)."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # a broken install can raise anything at import (a missing libcuda, a bad wheel)
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def interpreter_asked() -> bool:
    """TRITON_INTERPRET as Triton reads it (a bool: 1, true, on, yes)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes", "y")


def resolve(device: str, kernels: str, local_rank: int = 0, distributed: bool = False,
            cuda: CudaFacts | None = None) -> tuple[str, str]:
    """(device type, kernels) this process trains with, or a ConfigError; the facts are gathered here."""
    cuda = cuda if cuda is not None else cuda_facts()
    chosen = choose_device(device, cuda, local_rank, distributed)
    index = local_rank if distributed else 0
    on_gpu = chosen == "cuda" and index < len(cuda.capabilities)
    wants_triton = kernels == "triton" or (kernels == "auto" and chosen == "cuda")
    picked = choose_kernels(kernels, chosen, capability=cuda.capabilities[index] if on_gpu else None,
                            device_name=f"cuda:{index} ({cuda.names[index]})" if on_gpu else "",
                            triton_error=triton_import_error() if wants_triton else None,
                            interpreter=interpreter_asked())
    if kernels == "auto" and chosen == "cuda" and picked == "torch":
        log.warning("train.kernels=auto: the plain-torch kernels (Triton cannot run on this GPU here)")
    return chosen, picked
