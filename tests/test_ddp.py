"""Data-parallel training under torchrun (2 gloo processes) equals single-process training."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tutorial_pkg.experiments.training import ExperimentConfig, train

ROOT = Path(__file__).resolve().parents[1]


def test_two_gloo_processes_train_as_one_process_with_the_same_global_batch(tmp_path):
    out = tmp_path / "ddp.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tutorial_pkg.experiments.distributed", "--encoding", "alibi", "--d-model", "32",
           "--n-layers", "1", "--n-heads", "2", "--train-len", "16", "--steps", "5",
           "--batch-size", "4", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = torch.load(out, weights_only=False)
    assert saved["world_size"] == 2
    cfg = ExperimentConfig(**{k: v for k, v in saved["config"].items() if k != "eval_multiples"},
                           eval_multiples=tuple(saved["config"]["eval_multiples"]))
    model, losses = train("alibi", cfg, progress=False)
    torch.testing.assert_close(torch.tensor(saved["losses"]), torch.tensor(losses),
                               rtol=1e-5, atol=1e-5)
    ref = model.state_dict()
    assert set(saved["state_dict"]) == set(ref)
    for name, value in saved["state_dict"].items():
        torch.testing.assert_close(value, ref[name], rtol=1e-4, atol=1e-5, msg=name)
    assert losses[-1] < losses[0]  # it trained


def test_train_ddp_outside_torchrun_says_so(monkeypatch):
    from tutorial_pkg.experiments.distributed import train_ddp

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        train_ddp("alibi", ExperimentConfig(d_model=16, n_layers=1, n_heads=2, steps=1,
                                            train_len=8, eval_tokens=64, device="cpu"))
