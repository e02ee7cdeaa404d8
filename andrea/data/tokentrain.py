"""Training the run's tokenizer on a sample of its arms, in a child process that a stop request ends at once.

Reads the arms' source files (the sample: `sample_texts`, `budget` bytes drawn across arms and files); returns the
trained tokenizer (HF tokenizers' JSON, which prepare.py writes to `tokenizer.json`) with the sample's size and
what the sample met that is not text (read.Counts). A sample over `IN_PROCESS_BYTES` is trained in a spawned child
process: HF tokenizers' training cannot be interrupted from Python, so the parent polls `should_stop` every
`POLL_SECONDS` and kills the child when asked, and logs how far the training got every `LOG_SECONDS`. A smaller
sample trains in well under a second and is trained in-process (the same function, without the process).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import time
import traceback
from collections.abc import Callable, Iterator

from andrea.data import read
from andrea.data.codec import TextCodec
from andrea.data.encode import Interrupted, TextArm
from andrea.data.sources import DataError

log = logging.getLogger("andrea.data")
IN_PROCESS_BYTES = 1 << 20  # a sample this small trains in < 1 s (32K vocabulary, two cores)
POLL_SECONDS = 0.1
LOG_SECONDS = 5.0
REPORT_BYTES = 1 << 20  # the child reports the sample read every MiB


def expected_bytes(arms: list[TextArm], plans: dict[str, list[dict]], budget: int) -> int:
    """An upper bound of the sample's size, from the files' sizes where they are known."""
    total = 0
    for arm in arms:
        sizes = [e["size"] for e in plans[arm.name]]
        known = sum(sizes) if None not in sizes else budget
        total += min(known, arm.cap or known)
    return min(total, budget)


def sample_texts(arms: list[TextArm], plans: dict[str, list[dict]], budget: int, counts: read.Counts,
                 report: Callable[[int], None] = lambda n: None) -> Iterator[str]:
    """`budget` bytes of text drawn across the arms: each arm in turn gets an equal share of what is left (an arm
    smaller than its share leaves the rest to the arms after it)."""
    used, reported = 0, 0
    for k, arm in enumerate(arms):
        share = (budget - used) // (len(arms) - k)
        for text in arm.sample(share, plans[arm.name], counts):
            used += len(text.encode())
            if used - reported >= REPORT_BYTES:
                reported = used
                report(used)
            yield text


def train(arms: list[TextArm], plans: dict[str, list[dict]], budget: int, vocab_size: int,
          report: Callable[[int], None] = lambda n: None) -> tuple[str, int, dict]:
    """(tokenizer JSON, sample bytes, counts of the sample) — the training itself, wherever it runs."""
    counts = read.Counts()
    sized = _Sized(sample_texts(arms, plans, budget, counts, report))
    codec = TextCodec.train(sized, vocab_size)
    return codec.tokenizer.to_str(), sized.bytes, counts.to_dict()


class _Sized:
    def __init__(self, texts: Iterator[str]):
        self.texts, self.bytes = texts, 0

    def __iter__(self):
        for t in self.texts:
            self.bytes += len(t.encode())
            yield t


def _child(conn, arms, plans, budget, vocab_size) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides: it kills this process when asked to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:  # Linux: die with the parent (a SIGKILLed `andrea prepare` leaves no trainer behind)
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    try:
        result = train(arms, plans, budget, vocab_size, lambda n: conn.send(("read", n)))
        conn.send(("done", result))
    except DataError as e:
        conn.send(("data_error", str(e)))
    except BaseException:  # noqa: BLE001 (reported to the parent, which raises it there)
        conn.send(("crash", traceback.format_exc()))


def train_tokenizer(arms: list[TextArm], plans: dict[str, list[dict]], budget: int, vocab_size: int,
                    should_stop: Callable[[], bool]) -> tuple[TextCodec, int, dict]:
    """The trained codec, the sample's bytes and its counts; raises Interrupted within ~POLL_SECONDS of a stop."""
    stopped = Interrupted("data: preparation stopped while training the tokenizer; nothing is kept yet: run "
                          "`andrea prepare` or `andrea train` again to start it over")
    if should_stop():
        raise stopped
    expected = expected_bytes(arms, plans, budget)
    log.info("data: training the tokenizer (vocab %d) on a sample of up to %.1f MB of %d arm(s) "
             "(data.tokenizer_sample_bytes)", vocab_size, expected / 1e6, len(arms))
    if expected <= IN_PROCESS_BYTES:
        text, sample, counts = train(arms, plans, budget, vocab_size)
        return TextCodec.from_str(text), sample, counts
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold threads
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, arms, plans, budget, vocab_size), daemon=True,
                       name="andrea-tokenizer")
    proc.start()
    child.close()
    t0 = last_log = time.monotonic()
    read_bytes, message = 0, None
    try:
        while message is None:
            if should_stop():
                raise stopped
            if parent.poll(POLL_SECONDS):
                try:
                    kind, value = parent.recv()
                except EOFError:
                    raise RuntimeError(f"the tokenizer's training process ended without a result (exit code "
                                       f"{proc.exitcode})") from None
                if kind == "read":
                    read_bytes = value
                else:
                    message = (kind, value)
            if time.monotonic() - last_log >= LOG_SECONDS:
                last_log = time.monotonic()
                log.info("data: training the tokenizer: %.1f MB of the sample read, %.0f s", read_bytes / 1e6,
                         last_log - t0)
    finally:
        if message is None and proc.is_alive():
            proc.kill()
        proc.join()
        parent.close()
    kind, value = message
    if kind == "data_error":
        raise DataError(value)
    if kind == "crash":
        raise RuntimeError(f"training the tokenizer failed:\n{value}")
    text, sample, counts = value
    return TextCodec.from_str(text), sample, counts
