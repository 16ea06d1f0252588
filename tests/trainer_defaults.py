"""Small, fast RLTrainer settings shared by the tests (a module, not conftest, so that test
directories of plugins, each with their own conftest, can be collected in the same run)."""

from __future__ import annotations

from pathlib import Path


def tiny_trainer_kwargs(tmp_path: Path, **over) -> dict:
    kw = dict(
        max_iterations=3,
        group_size=4,
        rollout_batch_size=16,
        train_micro_batch_size=8,
        default_root_dir=str(tmp_path / "run"),
        enable_progress_bar=False,
        logger=False,
        seed=0,
        timeout_s=60,
    )
    kw.update(over)
    return kw
