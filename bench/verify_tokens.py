"""What `andrea verify` costs per GB of prepared tokens: the xxh3-128 pass over a token file (data/manifest.py's
`token_digest`), timed on a file written here (random uint16 ids, fsynced, then read cold when the page cache
allows dropping it: run as root, or the figure is the warm-cache one and says so).

    python bench/verify_tokens.py [--gb 1.0] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from andrea.data.manifest import token_digest  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="size of the token file (default 1 GB)")
    ap.add_argument("--dir", default=None, help="where the file goes (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path, nbytes = Path(d) / "arm.train.u16", int(args.gb * 1e9) // 2 * 2
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for lo in range(0, nbytes, 64 << 20):
                f.write(rng.integers(0, 65536, size=min(64 << 20, nbytes - lo) // 2, dtype="<u2").tobytes())
            f.flush()
            os.fsync(f.fileno())
        cold = True
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
        except OSError:
            cold = False
        t = time.perf_counter()
        token_digest(path, nbytes)
        dt = time.perf_counter() - t
    print(f"token_digest of {nbytes / 1e9:.2f} GB ({'cold' if cold else 'warm'} page cache): {dt:.2f} s, "
          f"{dt / (nbytes / 1e9):.2f} s per GB, {nbytes / 1e9 / dt:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
