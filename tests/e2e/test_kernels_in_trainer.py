"""The trainer with --kernels triton (Triton interpreter on CPU) follows the plain-torch loss curve."""

import math

from tests.runs import ledger, seed_data, train


def test_triton_kernels_follow_the_torch_loss_curve(prepared, tmp_path):
    curves = {}
    for kernels in ("torch", "triton"):
        run = seed_data(prepared, tmp_path / kernels)
        # One sequence a batch: the interpreter runs every kernel program in Python, ~12 ms each whatever its work
        # (LayerNorm's one program per row: 70 % of a step), and two sequences took 9 s a step (one core); the
        # kernels' shapes and odd sizes are tests/unit/kernels' job, this one is the trainer's wiring.
        result = train(run, "--steps", "4", "--kernels", kernels, "--checkpoint-every", "1000",
                       "--set", "train.batch_size=1")
        assert result.returncode == 0, result.stderr
        assert f"kernels={kernels}" in result.stdout
        curves[kernels] = [e["loss"] for e in ledger(run) if "event" not in e]
    assert len(curves["torch"]) == len(curves["triton"]) == 4
    # Same math in fp32 with a different summation order (flash attention's online softmax, the fused update):
    # per-step differences are ~1e-7 relative and compound over a few updates; 1e-5 relative is ~100x that and
    # still far below any real divergence (a wrong mask or update moves the loss by > 1e-2).
    for a, b in zip(curves["torch"], curves["triton"]):
        assert math.isclose(a, b, rel_tol=1e-5), (curves["torch"], curves["triton"])
    assert curves["triton"][-1] < curves["triton"][0]
