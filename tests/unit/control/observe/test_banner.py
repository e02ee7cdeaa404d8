"""control/observe/banner.py: the start banner names the preset (or says the model is custom), the size, tokens per
step, the optimizer and schedule, the checkpoint cadence, directory and replica, and the target."""

from __future__ import annotations

from pathlib import Path

from andrea.config import load as configload
from andrea.control.observe import banner


def test_the_preset_is_named_from_the_model_section_and_a_changed_model_is_custom():
    cfg = configload.load(preset="andrea-12m-modern")
    assert banner.preset_of(cfg.model) == "andrea-12m-modern"
    cfg.model.n_layer += 1
    assert banner.preset_of(cfg.model) is None


def test_the_lines_say_what_runs_where_and_until_when():
    cfg = configload.load(preset="andrea-120m", overrides=['checkpoint.replica="s3://bucket/runs/a"'])
    model, batch, saves, target = banner.lines(cfg, preset="andrea-120m", n_params=120_445_440, step=1200,
                                               stop_at=200_000, device="cuda:0", kernels="triton",
                                               run_dir=Path("/srv/runs/a"))
    assert model.startswith("model: andrea-120m (gpt2), 120,445,440 params (12 layers, d 768, 12 heads, ctx 1024")
    assert model.endswith("; cuda:0/triton")
    assert batch.startswith(f"batch: 16 x 1024 = 16,384 tokens/step; adamw lr {cfg.train.lr:g}, ")
    assert saves == (f"checkpoints: every {cfg.checkpoint.every:,} steps into /srv/runs/a (last "
                     f"{cfg.checkpoint.keep_last} kept + every {cfg.checkpoint.keep_every:,}th); "
                     "replica: s3://bucket/runs/a")
    assert target.startswith("target: step 200,000 from step 1,200: 198,800 steps, 3.26B tokens (`--steps N`")


def test_a_recorded_anneal_is_where_the_lr_ends():
    cfg = configload.load(preset="andrea-tiny", overrides=["train.schedule=wsd", "train.warmdown_steps=400",
                                                          "train.anneal_at=300", "train.anneal_steps=60"])
    _, batch, _, _ = banner.lines(cfg, preset="andrea-tiny", n_params=1, step=310, stop_at=360, device="cpu",
                                  kernels="torch", run_dir=Path("/srv/runs/a"))
    assert batch.endswith(f"annealed from step 300 to {cfg.train.min_lr:g} at 360 (a pivot's anneal)"), batch
    assert "at 2,000" not in batch  # the schedule's own horizon no longer says where the lr ends
