"""Micro-batches (gradient accumulation), activation checkpointing and the memory estimate (issue #22).

In process (no data, random tokens of a fixed seed): micro-batched steps follow the plain ones, activation
checkpointing recomputes every block and gives the same bytes (torch and Triton paths), the "auto" fallback
halves on an injected out-of-memory error, bad values are refused, the estimate matches what autograd saves.
With real processes on the tiny preset: the ledger of a micro-batched run follows the plain run's, a SIGTERM and
resume is bit-exact, "auto" is recorded in run.toml and the ledger and reused on resume, and two torchrun ranks
with micro-batches follow one process.

Tolerances. A micro-batch runs the same per-row math as the whole batch (the forward of a row does not depend on
the other rows: the losses come out bit-identical at equal weights); what differs is the order of the weight
gradients' sums over rows (B/b partial sums added into the flat gradient), ~1e-7 relative in fp32. Measured on
the tiny shapes below: grad norms within 1.1e-7 relative, weights within 9e-7 absolute after 4 updates at lr
1e-3; over 12 steps of the tiny preset the ledger's losses equal the plain run's and its grad norms are within
2e-7 relative (1.5e-6 with two ranks, which also split the gradient's mean over ranks). The bounds are >= 10x those,
and far below what a broken accumulation gives: a gradient not divided over the micro-batches is k times the
norm, one that keeps only the last micro-batch moves the weights by ~lr = 1e-3 per step.
"""

import json
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from andrea import cli
from andrea.config import load as configload
from andrea.model import memory
from andrea.config.check import ConfigError
from andrea.control.parallel.distributed import check_batch
from andrea.model.gpt import layout_for, n_params
from andrea.rundir import checkpoint as ckpt, names
from andrea.rundir.ledger import history
from andrea.control.run.trainer import Trainer
from tests.runs import ROOT, Trainer as Process, env, launcher_argv, ledger, seed_data, train
from tests.activations import saved_bytes

LOSS_RTOL, NORM_RTOL, WEIGHT_ATOL = 1e-5, 1e-5, 1e-5
TINY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 300}
FAR = ["--checkpoint-every", "100000"]


def tiny_cfg(**train):
    return configload.from_dict({"model": TINY_MODEL, "train": {"batch_size": 8, "warmup_steps": 2, "lr": 1e-3,
                                                            **train}})


def batches(n: int, rows: int = 8, T: int = 16, V: int = 300):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(0, V, (rows, T), generator=gen), torch.randint(0, V, (rows, T), generator=gen))
            for _ in range(n)]


def run_steps(trainer: Trainer, data) -> list[tuple[float, float]]:
    out = [trainer.train_step(s, x, y) for s, (x, y) in enumerate(data)]
    trainer._wait_snapshot()
    return [(float(o.loss), float(o.grad_norm)) for o in out]


def count_calls(module: torch.nn.Module) -> list[int]:
    """A counter of module's forward runs (wrapping forward itself: checkpoint's recomputation skips hooks)."""
    calls, forward = [0], module.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)
    module.forward = counted
    return calls


# --- micro-batches in process ---------------------------------------------------------------------------------
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_micro_batches_follow_the_plain_run(micro):
    data = batches(4)
    plain = Trainer(tiny_cfg(), torch.device("cpu"))
    ref = run_steps(plain, data)
    t = Trainer(tiny_cfg(micro_batch_size=micro), torch.device("cpu"))
    passes = count_calls(t.model)
    got = run_steps(t, data)
    assert passes[0] == 4 * (8 // micro)  # the step really ran in micro-batches
    for (loss, norm), (ref_loss, ref_norm) in zip(got, ref):
        assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL)  # the mean over the whole batch
        assert norm == pytest.approx(ref_norm, rel=NORM_RTOL)  # one gradient of the whole batch, not k
    assert (t.state.buffer - plain.state.buffer).abs().max() <= WEIGHT_ATOL  # w, m and v
    assert not torch.equal(plain.state.w, Trainer(tiny_cfg(), torch.device("cpu")).state.w)  # it trained


def test_with_dropout_micro_batches_are_deterministic_but_draw_their_own_masks():
    """docs/operating.md: the step's seed is set once and the passes draw from it in turn, so a micro-batched run
    repeats itself bit for bit, and its masks (hence its weights) differ from the plain run's by more than
    float summation order would explain."""
    def dropout_cfg(**train):
        return configload.from_dict({"model": {**TINY_MODEL, "dropout": 0.2},
                                     "train": {"batch_size": 8, "warmup_steps": 2, "lr": 1e-3, **train}})

    data = batches(3)
    a, b = (Trainer(dropout_cfg(micro_batch_size=2), torch.device("cpu")) for _ in range(2))
    run_steps(a, data), run_steps(b, data)
    assert torch.equal(a.state.buffer, b.state.buffer)
    plain = Trainer(dropout_cfg(), torch.device("cpu"))
    run_steps(plain, data)
    assert (a.state.buffer - plain.state.buffer).abs().max() > 100 * WEIGHT_ATOL


def test_a_micro_batch_as_large_as_the_batch_is_the_plain_run_bit_for_bit():
    data = batches(2)
    a, b = Trainer(tiny_cfg(), torch.device("cpu")), Trainer(tiny_cfg(micro_batch_size=8), torch.device("cpu"))
    assert run_steps(a, data) == run_steps(b, data)
    assert torch.equal(a.state.buffer, b.state.buffer)


def test_eval_runs_in_micro_batches_too():
    t = Trainer(tiny_cfg(micro_batch_size=2), torch.device("cpu"))
    passes = count_calls(t.model)
    (x, y), = batches(1)
    whole = Trainer(tiny_cfg(), torch.device("cpu")).loss_of(x, y)
    assert float(t.loss_of(x, y)) == pytest.approx(float(whole), rel=1e-6)
    assert passes[0] == 4


# --- activation checkpointing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_activation_checkpointing_recomputes_the_blocks_and_gives_the_same_bytes(kernels):
    # Triton runs in its interpreter on CPU (tests/conftest.py): the smallest shapes that take its code paths.
    n = 2 if kernels == "torch" else 1
    rows = 8 if kernels == "torch" else 2
    data = batches(n, rows=rows)
    cfg = lambda ac: tiny_cfg(activation_checkpointing=ac, batch_size=rows)  # noqa: E731
    plain, ck = Trainer(cfg("none"), torch.device("cpu"), kernels), Trainer(cfg("blocks"), torch.device("cpu"), kernels)
    blocks = count_calls(ck.model.h[0])
    assert run_steps(plain, data) == run_steps(ck, data)
    assert torch.equal(plain.state.buffer, ck.state.buffer)  # weights, m and v: the same bytes
    assert blocks[0] == 2 * n  # each step ran block 0 twice: forward, and again in the backward
    x, y = data[0]
    assert saved_bytes(ck, x, y) < 0.7 * saved_bytes(plain, x, y)


# --- the memory estimate ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ac", ["none", "blocks"])
def test_the_estimate_counts_what_autograd_saves(ac):
    cfg = configload.from_dict({"model": {"n_layer": 3, "n_head": 4, "n_embd": 64, "block_size": 32,
                                      "vocab_size": 512}, "train": {"activation_checkpointing": ac}})
    t = Trainer(cfg, torch.device("cpu"))
    rows = 4
    x, y = (torch.randint(0, 512, (rows, 32), generator=torch.Generator().manual_seed(1)) for _ in range(2))
    est = memory.estimate(cfg.model, t.n, rows, activation_checkpointing=ac, device="cpu")
    tokens = rows * 32
    # saved: the activations and the log-probabilities; under checkpointing the estimate also counts the one block
    # whose activations are recomputed at a time in the backward (not saved by the forward)
    inside = tokens * memory.block_bytes_per_token(cfg.model, "cpu") if ac == "blocks" else 0
    expected = est.activations - inside + tokens * 512 * 4
    assert saved_bytes(t, x, y) == pytest.approx(expected, rel=0.03)
    assert est.parameters == est.gradient == 4 * t.n and est.adam_m_v == 8 * t.n


def test_the_estimate_shrinks_with_micro_batches_and_checkpointing():
    cfg = configload.load(preset="andrea-120m")
    n = n_params(layout_for(cfg.model))
    totals = [memory.estimate(cfg.model, n, b).total for b in (16, 8, 4)]
    assert totals[0] > totals[1] > totals[2] > 16 * n
    assert memory.estimate(cfg.model, n, 16, activation_checkpointing="blocks").total < totals[0]
    assert memory.estimate(cfg.model, n, 16, world_size=2).adam_m_v == 8 * -(-n // 2)


def test_info_prints_the_estimate(capsys):
    assert cli.main(["info", "--preset", "andrea-12m", "--micro-batch-size", "4", "--activation-checkpointing",
                     "--device", "cpu"]) == 0
    out = capsys.readouterr()
    mem = json.loads(out.out)["memory"]
    assert (mem["micro_batch_size"], mem["activation_checkpointing"], mem["device"]) == (4, "blocks", "cpu")
    assert mem["total"] == sum(mem[k] for k in ("parameters", "gradient", "adam_m_v", "activations", "logits"))
    assert "total" in out.err and "micro-batch 4 of 32" in out.err
    assert cli.main(["info", "--preset", "andrea-12m", "--micro-batch-size", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("andrea: error: ") and "micro_batch_size=5 does not divide" in err


# --- "auto": the out-of-memory fallback -------------------------------------------------------------------------
def test_the_fallback_halves_to_a_divisor_of_the_batch():
    assert memory.next_micro_batch(8, 8) == 4
    assert memory.next_micro_batch(8, 2) == 1
    assert memory.next_micro_batch(12, 12) == 6 and memory.next_micro_batch(12, 6) == 3
    assert memory.next_micro_batch(12, 3) == 1  # 1.5 rows is no slice: the next divisor below
    assert memory.next_micro_batch(18, 9) == 3  # 4 rows do not divide 18
    assert memory.next_micro_batch(12, 1) is None
    assert memory.micro_batch_rows("auto", 16) == memory.micro_batch_rows(0, 16) == 16


def test_auto_halves_on_out_of_memory_and_runs_the_same_step_as_that_micro_batch():
    data = batches(3)
    t = Trainer(tiny_cfg(micro_batch_size="auto"), torch.device("cpu"))
    t._oom_rows = 2  # an injected out-of-memory error for passes over more than 2 rows, after their forward
    got = run_steps(t, data)
    assert t.micro_batch == 2
    assert t.micro_batch_choice == {"micro_batch_size": 2, "rows": 8, "out_of_memory_at": [8, 4]}
    ref = Trainer(tiny_cfg(micro_batch_size=2), torch.device("cpu"))
    assert got == run_steps(ref, data)
    assert torch.equal(t.state.buffer, ref.state.buffer)  # the failed passes left nothing in the gradient


def test_out_of_memory_is_not_caught_without_auto_or_after_the_first_step():
    t = Trainer(tiny_cfg(), torch.device("cpu"))
    t._oom_rows = 2
    with pytest.raises(torch.OutOfMemoryError):
        t.train_step(0, *batches(1)[0])
    t = Trainer(tiny_cfg(micro_batch_size="auto"), torch.device("cpu"))
    run_steps(t, batches(1))
    assert t.micro_batch == 8 and t.micro_batch_choice["out_of_memory_at"] == []
    t._oom_rows = 2
    with pytest.raises(torch.OutOfMemoryError):
        t.train_step(1, *batches(1)[0])


def test_auto_gives_up_at_one_row():
    t = Trainer(tiny_cfg(micro_batch_size="auto"), torch.device("cpu"))

    def no_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory")
    t.model.forward = no_memory
    with pytest.raises(torch.OutOfMemoryError, match="even at one row"):
        t.train_step(0, *batches(1)[0])


# --- bad values -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, problem", [(3, "does not divide train.batch_size=8"), (16, "does not divide"),
                                            (-1, "must be a positive integer"), (2.0, "must be a positive integer"),
                                            (True, "must be a positive integer"), ("half", "must be a positive")])
def test_bad_micro_batches_are_refused(value, problem):
    with pytest.raises(ConfigError, match=problem):
        tiny_cfg(micro_batch_size=value)


def test_bad_activation_checkpointing_is_refused():
    with pytest.raises(ConfigError, match="must be none or blocks"):
        tiny_cfg(activation_checkpointing="all")


def test_the_micro_batch_must_divide_each_ranks_rows():
    check_batch(8, 2, 2)
    check_batch(8, 2, "auto")
    with pytest.raises(ConfigError, match=r"micro_batch_size=8 does not divide the 4 rows of each of the 2 ranks"):
        check_batch(8, 2, 8)  # divides the global batch, not a rank's half
    with pytest.raises(ConfigError, match="micro_batch_size=3 does not divide the 4 rows"):
        check_batch(12, 3, 3)  # 3 divides the global 12, not a rank's 4
    check_batch(12, 4, 3)


def test_train_refuses_a_bad_micro_batch_in_one_line(tmp_path):
    result = train(tmp_path / "run", "--set", "train.micro_batch_size=3")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "andrea: error: " in result.stderr
    assert "train.micro_batch_size=3 does not divide train.batch_size=8" in result.stderr


# --- real runs on the tiny preset -------------------------------------------------------------------------------
STEPS = 12
MICRO = ["--set", "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def plain_run(prepared, tmp_path_factory):
    run = seed_data(prepared, tmp_path_factory.mktemp("plain"))
    result = train(run, "--steps", str(STEPS), *FAR)
    assert result.returncode == 0, result.stderr
    return run


def step_entries(run_dir) -> dict[int, dict]:
    return {e["step"]: e for e in ledger(run_dir) if "event" not in e}


def assert_ledger_follows(run_dir, reference, loss_rtol=LOSS_RTOL, norm_rtol=NORM_RTOL) -> None:
    got, ref = step_entries(run_dir), step_entries(reference)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for s in ref:
        assert got[s]["tokens"] == ref[s]["tokens"] and got[s]["lr"] == ref[s]["lr"]
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=loss_rtol), s
        assert got[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=norm_rtol), s


def test_sigterm_mid_run_and_resume_with_micro_batches_is_bit_exact(plain_run, prepared, tmp_path):
    straight = seed_data(prepared, tmp_path / "straight")
    assert train(straight, "--steps", str(STEPS), *FAR, *MICRO).returncode == 0
    assert_ledger_follows(straight, plain_run)
    run = seed_data(prepared, tmp_path / "run")
    t = Process(run, "--steps", str(STEPS), *FAR, *MICRO, "--set", "train.log_every=1",
                extra_env={"ANDREA_TEST_STEP_DELAY": "0.3"})
    try:
        t.wait_ready()
        t.wait_for(lambda l: (m := re.search(r"step (\d+)/", l)) is not None and int(m.group(1)) >= 3)
        t.proc.send_signal(signal.SIGTERM)
        assert t.wait_exit(30) == 0
    finally:
        t.kill()
    stopped_at = ckpt.list_checkpoints(run)[-1][0]
    assert 3 <= stopped_at < STEPS
    assert train(run, "--steps", str(STEPS), *FAR).returncode == 0  # run.toml keeps the micro-batch
    name = names.checkpoint_name(STEPS)
    assert (run / name).read_bytes() == (straight / name).read_bytes()


def test_auto_is_recorded_and_reused_on_resume(plain_run, prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    oom = {"ANDREA_TEST_OOM_ROWS": "2"}
    first = train(run, "--steps", "4", *FAR, "--set", "train.micro_batch_size=auto", extra_env=oom)
    assert first.returncode == 0, first.stderr
    assert len(re.findall(r"out of memory at \d+ rows per pass", first.stderr)) == 2  # 8 -> 4 -> 2
    assert 'micro_batch_size = 2' in (run / "run.toml").read_text()
    [mark] = [e for e in ledger(run) if e.get("event") == "micro_batch"]
    assert (mark["micro_batch_size"], mark["out_of_memory_at"], mark["step"]) == (2, [8, 4], 0)
    again = train(run, "--steps", str(STEPS), *FAR, extra_env=oom)  # a resume: the recorded 2, no probing
    assert again.returncode == 0, again.stderr
    assert "out of memory" not in again.stderr
    assert [e for e in ledger(run) if e.get("event") == "micro_batch"] == [mark]
    assert_ledger_follows(run, plain_run)


def test_the_guard_rolls_a_micro_batched_run_back_and_it_heals(prepared, tmp_path):
    """A non-finite step in a run of micro-batches (ANDREA_TEST_POISON_STEPS=15, the loss of the accumulated batch
    reads NaN): the guard refuses it a checkpoint and rolls back to a committed checkpoint before it, the rollback's
    replay reaches step 20, and every checkpoint is valid."""
    run = seed_data(prepared, tmp_path / "run")
    r = train(run, "--steps", "20", "--checkpoint-every", "5", "--set", "guard.confirm_steps=5", *MICRO,
              extra_env={"ANDREA_TEST_POISON_STEPS": "15"})
    assert r.returncode == 0, r.stderr[-4000:]
    [rollback] = [e for e in ledger(run) if e.get("event") == "rollback"]
    assert rollback["from"] == 15 and rollback["step"] in (5, 10), rollback
    assert rollback["checkpoint"] == names.checkpoint_name(rollback["step"])
    assert [e["step"] for e in history(ledger(run)) if "event" not in e] == list(range(1, 21))
    assert ckpt.list_checkpoints(run)[-1][0] == 20
    assert cli.main(["verify", str(run)]) == 0


def test_two_ranks_with_micro_batches_follow_one_process(plain_run, prepared, tmp_path):
    from tests.sharding import LOSS_RTOL as DIST_LOSS_RTOL, NORM_RTOL as DIST_NORM_RTOL
    run = seed_data(prepared, tmp_path / "run")
    # "auto" with an injected out-of-memory error above 2 rows: both ranks (4 rows each) halve to 2 together.
    result = subprocess.run(launcher_argv(run, "--steps", str(STEPS), *FAR, "--set", "train.micro_batch_size=auto"),
                            capture_output=True, text=True, timeout=300, env={**env(), "ANDREA_TEST_OOM_ROWS": "2"},
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    [mark] = [e for e in ledger(run) if e.get("event") == "micro_batch"]
    assert (mark["micro_batch_size"], mark["rows"], mark["out_of_memory_at"]) == (2, 4, [4])
    assert_ledger_follows(run, plain_run, DIST_LOSS_RTOL, DIST_NORM_RTOL)
    name = names.checkpoint_name(STEPS)
    a, b = (np.fromfile(d / name, dtype="<f4", offset=8) for d in (run, plain_run))
    assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()


def test_the_memory_bench_runs_and_prints_its_table():
    # One micro-batch, 4 of the batch's 8 rows: two peak processes (without and with checkpointing) and the speed
    # one, where every further --micro value is one more process that imports torch to take the same code path.
    result = subprocess.run([sys.executable, "bench/memory.py", "--preset", "andrea-tiny", "--micro", "4",
                             "--steps", "1", "--threads", "1", "--device", "cpu"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"\s+\d+\s+(none|blocks)\s", line)]
    assert [(r[0], r[1]) for r in rows] == [("4", "none"), ("4", "blocks")]
    assert all(float(r[3]) > 0 for r in rows)  # every peak measured, relative to the plain run's
