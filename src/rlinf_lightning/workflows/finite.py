"""The non-finite guard of the stages that make a learner's targets: NaN or infinity in rewards or
advantages would reach every sample of a step, so the run stops there, naming the stage, the
iteration and what was not finite, before any update or checkpoint takes it in. (A learner's own
loss and gradient norm are guarded step by step in ``workflows.training.TrainStage.step``.)"""

from __future__ import annotations

import torch

from rlinf_lightning.errors import NonFiniteError


def check_finite(stage: str, iteration: int, what: str, values: torch.Tensor) -> None:
    """Raise :class:`NonFiniteError` when ``values`` (``what``, e.g. ``rewards``) hold NaN or inf."""
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return
    kinds = [k for k, m in (("nan", torch.isnan(values)), ("inf", torch.isinf(values))) if bool(m.any())]
    raise NonFiniteError(
        f"stage {stage!r} stopped the run: non-finite {what} at iteration {iteration} "
        f"({int(bad.sum())} of {values.numel()} values {' and '.join(kinds)}); nothing was trained on them"
    )
