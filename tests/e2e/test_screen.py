"""What a person sees of a training start (control/observe/progress.py, control/observe/banner.py): under a terminal
(a real pty) every log line is printed above the tqdm bar, never glued to a bar fragment; outside one the first
progress line comes at the first step, and a banner says what will run before it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

from tests.runs import ROOT, TINY, env, seed_data, train

LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) ")


def under_a_terminal(argv: list[str], timeout: float = 300) -> str:
    """`python -m andrea ARGV` with stdin, stdout and stderr on a pty of 160 x 40; everything it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "andrea", *argv], stdin=slave, stdout=slave, stderr=slave,
                            env=env(), cwd=ROOT)
    os.close(slave)
    out = bytearray()
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child's side of the pty closed
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout) == 0, out.decode(errors="replace")[-3000:]
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return out.decode(errors="replace")


def test_under_a_terminal_log_lines_are_printed_above_the_bar_never_glued_to_it(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    # a checkpoint every 4 steps: its log line comes while the bar is drawn
    screen = under_a_terminal(["train", *TINY, "--run-dir", str(run), "--steps", "12", "--checkpoint-every", "4"])
    first_bar = screen.index("step/s")
    during = [m for m in LOG_LINE.finditer(screen) if m.start() > first_bar and "committed" in
              screen[m.start():screen.find("\n", m.start())]]
    assert len(during) >= 2, screen[-3000:]  # step_000004 and step_000008 were committed under the bar
    for m in LOG_LINE.finditer(screen):  # each log line begins a line of the screen: after \n or \r, never "…]2026"
        assert m.start() == 0 or screen[m.start() - 1] in "\r\n", repr(screen[max(m.start() - 80, 0):m.end() + 40])


def test_outside_a_terminal_a_banner_then_the_first_progress_line_at_the_first_step(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    result = train(run, "--steps", "3", "--checkpoint-every", "1000")  # train.log_every = 10: after the target
    assert result.returncode == 0, result.stderr
    said = [line.split(": ", 1)[1] for line in result.stderr.splitlines() if ": " in line]
    first = [s for s in said if s.startswith("step ")]
    assert first and first[0].startswith("step 1/3 loss "), result.stderr[-3000:]
    banner = {s.split(":", 1)[0]: s for s in said if s.split(":", 1)[0] in ("model", "batch", "checkpoints",
                                                                           "target")}
    assert banner["model"].startswith("model: andrea-tiny (gpt2), 169,728 params"), banner
    assert "8 x 64 = 512 tokens/step" in banner["batch"], banner
    assert banner["checkpoints"] == f"checkpoints: every 1,000 steps into {run} (last 5 kept + every 10,000th); " \
                                    "replica: none", banner
    assert banner["target"].startswith("target: step 3 from scratch: 3 steps, 1.54K tokens"), banner
    # the banner precedes the first step
    assert result.stderr.index("target: step 3") < result.stderr.index("step 1/3")
