"""The replica's cost: training steps/s with and without `checkpoint.replica`, and its upload throughput.

1. Steps/s. The same run (one preset, seed and data, `--checkpoint-every K`) trained `--steps` steps in fresh run
   directories, without a replica and with one on a local SeaweedFS (tests/s3server.py: the real S3 server of the
   tests, on loopback), back to back as a pair (the order alternating), `--repeats` pairs. Steps/s is read from the
   ledger: the step entries' times from step max(K, steps/5) to the last step (process start-up, data preparation
   and the replica's first pass, which sends the prepared data, excluded). A shared machine's speed drifts by
   +-10 % over minutes, more than the effect measured; the two runs of a pair see the same machine, so the verdict
   is the median of the pairs' ratios (with / without >= 0.98: uploads run on their own thread, never on a step's
   path). Each side's best and median are printed beside it.
   The default cadence, a checkpoint every 100 steps (~2 s of andrea-tiny on one core), gives the replica one new
   checkpoint per pass (control/replica/replicator.py starts a pass at most every MIN_INTERVAL = 2 s): every checkpoint
   is replicated, at ~500 times a real run's rate (one every ~17 minutes). `--every 10` shows the coalesced regime:
   ~11 checkpoints land per pass and each pass uploads the keep_last newest.
   Where the cost goes: during the with-replica runs the trainer's threads' CPU time is read from /proc/PID/task
   every 0.2 s; the replica's share is that of the `andrea-replica` thread and obstore's runtime (`tokio-rt-*`) in
   the trainer's CPU over the same steps. On one core that share is what the steps lose.
   The local server runs at niceness `--server-nice` (10), on `--server-cpus` if given: in production the store's
   CPU is another machine's, here it shares the trainer's two cores.
2. Upload throughput. One synthetic checkpoint of `--params` parameters (ANDREA-12M's by default: 152 MB), with its
   companions and `.sum.json`, uploaded (a) as andrea publishes it, `control/replica/remote.py`'s `upload_checkpoint`:
   hashed on the way (xxh3 against `.sum.json`, MD5 per part), the store's multipart ETag checked, companions,
   `.sum.json` last; (a') the same where the ETag vouches for nothing (an encrypted object, another store): read
   back and hashed again; and (b) as a plain
   `obstore.put(store, key, Path(file))` of the same file with the same library. MB/s of the checkpoint's bytes,
   the median of `--uploads` tries each; the read-back is also timed on its own.

Timings describe this machine (2 shared cores: the server, the trainer and the uploader share them); nothing here
fails on them. Writes only temporary directories; prints a markdown report.

    python bench/replica.py --server-cpus 1 --trainer-cpus 0    # andrea-tiny, 800 steps, every 100, 8 pairs
    python bench/replica.py --every 10 --server-cpus 1 --trainer-cpus 0
    python bench/replica.py --steps 200 --repeats 1 --uploads 1 --params 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andrea.rundir.checkpoint_write import commit_checkpoint
from andrea.control.replica import remote as rep  # noqa: E402
from andrea.rundir.names import checkpoint_name, companion_path  # noqa: E402
from tests.s3server import BUCKET, S3Server  # noqa: E402


TICK = os.sysconf("SC_CLK_TCK")
REPLICA_THREADS = ("andrea-replica", "tokio-rt-")  # the replicator's thread, obstore's runtime


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of process `pid`: tid -> (its name, user + system CPU seconds so far), from /proc."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # the name may hold spaces: split after it
        out[int(tid)] = (stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / TICK)
    return out


def replica_share(samples: list[tuple[float, dict]], t0: float, t1: float) -> float | None:
    """The replica threads' share of the process's CPU between the samples nearest inside [t0, t1]."""
    inside = [(t, cpu) for t, cpu in samples if t0 <= t <= t1]
    if len(inside) < 2:
        return None
    (_, a), (_, b) = inside[0], inside[-1]
    spent = {tid: b[tid][1] - a.get(tid, (None, 0.0))[1] for tid in b}
    total = sum(spent.values())
    replica = sum(v for tid, v in spent.items() if b[tid][0].startswith(REPLICA_THREADS))
    return replica / total if total > 0 else None


def train(run_dir: Path, args, replica: str | None, env: dict) -> tuple[float, float | None]:
    """Steps/s of one run, from its ledger, and the replica threads' share of its CPU over the same steps."""
    cmd = [sys.executable, "-m", "andrea", "train", "--preset", args.preset, "--run-dir", str(run_dir),
           "--steps", str(args.steps), "--checkpoint-every", str(args.every), "--set", "sample.every=100000",
           "--set", "train.eval_every=100000"]
    if replica:
        cmd += ["--set", f'checkpoint.replica="{replica}"']
    if args.trainer_cpus:
        cmd = ["taskset", "-c", args.trainer_cpus, *cmd]
    errors = run_dir.with_name(run_dir.name + ".stderr")
    samples: list[tuple[float, dict]] = []
    with open(errors, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT)
        while proc.poll() is None:
            if replica:
                samples.append((time.time(), thread_cpu(proc.pid)))
            time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"train failed:\n{errors.read_text()[-2000:]}")
    entries = [json.loads(line) for line in (run_dir / ".loss.json").read_text().splitlines()]
    skip = max(args.every, args.steps // 5)  # past the start-up: the first pass sends the data, tokenizer, run.toml
    steps = [e for e in entries if "event" not in e and e["step"] >= skip]
    t0, t1 = steps[0]["time"], steps[-1]["time"]
    return (steps[-1]["step"] - steps[0]["step"]) / (t1 - t0), replica_share(samples, t0, t1)


def seed_from(template: Path, run_dir: Path) -> None:
    """The prepared tokenizer and data, copied (each run pays for training only)."""
    run_dir.mkdir(parents=True)
    subprocess.run(["cp", "-a", str(template / "tokenizer.json"), str(template / "data"), str(run_dir)], check=True)


def steps_bench(args, server: S3Server, work: Path) -> dict:
    env = {**os.environ, **server.env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    template = work / "template"
    subprocess.run([sys.executable, "-m", "andrea", "train", "--preset", args.preset, "--run-dir", str(template),
                    "--steps", "0"], check=True, capture_output=True, env=env, cwd=ROOT)
    rates: dict[str, list[float]] = {"without": [], "with": []}
    shares: list[float] = []
    for i in range(args.repeats):
        for label in (("without", "with") if i % 2 == 0 else ("with", "without")):  # alternate the order
            run_dir = work / f"{label}-{i}"
            seed_from(template, run_dir)
            uri = (str(Path(args.to_path) / f"replica-{i}") if args.to_path else f"s3://{BUCKET}/bench-{i}") \
                if label == "with" else None
            rate, share = train(run_dir, args, uri, env)
            rates[label].append(rate)
            if share is not None:
                shares.append(share)
    pairs = [w / wo for w, wo in zip(rates["with"], rates["without"])]
    return {"all": rates, "pairs": pairs, "shares": shares}


def synthetic_checkpoint(run_dir: Path, n: int) -> Path:
    run_dir.mkdir(parents=True)
    payload = np.random.default_rng(0).random(3 * n, dtype=np.float32)
    for kind in ("state", "guard", "ledger"):
        companion_path(run_dir, 100, kind).write_text("{}")
    return commit_checkpoint(run_dir, 100, payload)


def upload_bench(args, server: S3Server, work: Path) -> dict:
    import obstore
    os.environ.update(server.env())
    path = synthetic_checkpoint(work / "ckpt", args.params)
    size = path.stat().st_size
    replica = rep.Replica(f"s3://{BUCKET}/throughput")
    andrea_s, plain_s, readback_s, noetag_s = [], [], [], []
    for _ in range(args.uploads):
        t = time.perf_counter()
        obstore.put(replica.store, "plain.bin", path, chunk_size=rep.CHUNK, max_concurrency=4)
        plain_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        rep.upload_checkpoint(replica, path.parent, 100, lambda: None)
        andrea_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in replica.chunks(checkpoint_name(100)):
            pass
        readback_s.append(time.perf_counter() - t)
        etag_matches, rep.etag_matches = rep.etag_matches, lambda *_: False
        try:
            t = time.perf_counter()
            rep.upload_checkpoint(replica, path.parent, 100, lambda: None)
            noetag_s.append(time.perf_counter() - t)
        finally:
            rep.etag_matches = etag_matches
    mb = size / 1e6
    return {"bytes": size, "plain_MBps": mb / statistics.median(plain_s), "andrea_MBps": mb / statistics.median(andrea_s),
            "readback_MBps": mb / statistics.median(readback_s), "noetag_MBps": mb / statistics.median(noetag_s)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="andrea-tiny")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--every", type=int, default=100, help="checkpoint cadence of the timed runs")
    p.add_argument("--repeats", type=int, default=8, help="pairs of runs")
    p.add_argument("--params", type=int, default=12_723_200, help="parameters of the uploaded checkpoint")
    p.add_argument("--uploads", type=int, default=3)
    p.add_argument("--to-path", metavar="DIR", default=None,
                   help="replicate the timed runs to plain directories under DIR instead of the S3 server (no server "
                        "CPU); DIR must be on another filesystem than the temporary run directories (a replica on "
                        "the run's own disk is refused)")
    p.add_argument("--server-nice", type=int, default=10,
                   help="niceness of the local S3 server: its CPU stands for a remote store's, not the trainer's")
    p.add_argument("--server-cpus", default=None,
                   help="run the S3 server on these CPUs only (taskset -c), e.g. 1: a core of its own, as a remote "
                        "store's would be")
    p.add_argument("--trainer-cpus", default=None, help="run the trainer on these CPUs only (taskset -c)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="andrea-bench-replica-") as tmp:
        work = Path(tmp)
        server = S3Server(work / "s3", nice=args.server_nice, cpus=args.server_cpus).start()
        try:
            steps = steps_bench(args, server, work)
            upload = upload_bench(args, server, work)
        finally:
            server.stop()
    rates, pairs, shares = steps["all"], steps["pairs"], steps["shares"]
    ratio = statistics.median(pairs)
    print(f"## Replica cost ({args.preset}, {args.steps} steps, checkpoint every {args.every}, "
          f"{args.repeats} pair(s), {'a plain directory' if args.to_path else 'local SeaweedFS'}; server CPUs "
          f"{args.server_cpus or 'any'}, trainer CPUs {args.trainer_cpus or 'any'})\n")
    print("| run | steps/s (best) | median | each, in pair order |\n|---|---|---|---|")
    for label in ("without", "with"):
        print(f"| {label} replica | {max(rates[label]):.2f} | {statistics.median(rates[label]):.2f} | "
              f"{', '.join(f'{r:.2f}' for r in rates[label])} |")
    print(f"| with / without, each pair | | {ratio:.3f} | {', '.join(f'{r:.3f}' for r in pairs)} |")
    print(f"\n- ratio with / without: {ratio:.3f}, the median of {len(pairs)} back-to-back pairs -> "
          f"{'PASS' if ratio >= 0.98 else 'MISS'} (target >= 0.98); best / best "
          f"{max(rates['with']) / max(rates['without']):.3f}, median / median "
          f"{statistics.median(rates['with']) / statistics.median(rates['without']):.3f}")
    if shares:
        print(f"- the replica's threads (andrea-replica, obstore's runtime) took {100 * statistics.median(shares):.2f} % "
              f"of the trainer's CPU over the timed steps (median of {len(shares)} runs; each "
              f"{', '.join(f'{100 * x:.2f}' for x in shares)} %)")
    print(f"\n## Upload of one {upload['bytes'] / 1e6:.0f} MB checkpoint (median of {args.uploads})\n")
    print("| upload | MB/s |\n|---|---|")
    print(f"| plain obstore.put of the file | {upload['plain_MBps']:.0f} |")
    print(f"| andrea (hashed, ETag checked, companions, .sum.json last) | {upload['andrea_MBps']:.0f} |")
    print(f"| andrea where the ETag vouches for nothing (+ read back and hashed) | {upload['noetag_MBps']:.0f} |")
    print(f"| the read-back alone (GET, streamed) | {upload['readback_MBps']:.0f} |")
    print(f"\n- andrea / plain: {upload['andrea_MBps'] / upload['plain_MBps']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
