"""`python -m andrea ARGS…` run in this process, then its peak memory written to a JSON file: how
bench/gpu_train.py measures the real trainer's peak against `andrea info`'s estimate without changing andrea.

    python bench/train_peak.py PEAK_JSON train --preset andrea-12m --run-dir DIR …

The command line, its signals (SIGUSR1, SIGTERM: andrea's own handlers, this is the process they land in), its
output and its exit status are andrea's. At exit PEAK_JSON holds {"exit": status, "device": "cuda" | "cpu",
"max_allocated": bytes, "max_reserved": bytes} on CUDA (torch's caching allocator: what tensors held at the peak,
and what the allocator took from the driver), or the process's peak RSS on CPU ("max_rss"). Nothing else is
written.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repository, not bench/: `andrea` as -m sees it


def peak() -> dict:
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"device": "cuda", "max_allocated": torch.cuda.max_memory_allocated(),
                "max_reserved": torch.cuda.max_memory_reserved()}
    return {"device": "cpu", "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    status: int | str = "exception"
    try:
        from andrea.cli import main as andrea_main
        status = andrea_main(argv)
        return status
    finally:
        out.write_text(json.dumps({"exit": status, **peak()}))


if __name__ == "__main__":
    sys.exit(main())
