"""TokenBudget: what the stages that run the model over whole micro-batches share about their size.

The actor, the critic and the inference stage each cut their micro-batches by a token budget
(``workflows/padding.py``). When none is configured (nor a micro-batch size), the plan's memory
check (``flow.memory.fit_budgets``) calls :meth:`TokenBudget.fit_budget` with the bytes the stage
may use on its device, and the stage takes the most tokens whose predicted peak fits
(``flow.budget``: its own per-token cost model, :meth:`TokenBudget.budget_cost`), logged. Its
:meth:`~rlinf_lightning.flow.stage.Stage.memory` then counts that peak as working memory
(:meth:`TokenBudget.with_working`), so the check compares the plan's real need with the device.
"""

from __future__ import annotations

import dataclasses

from rlinf_lightning.flow.budget import Budget, StepCost, fit_tokens
from rlinf_lightning.flow.stage import MemoryPart


class TokenBudget:
    """Mixin of a stage with a ``policy``, ``max_prompt_tokens`` and ``horizon`` (the longest
    sample is their sum). Subclasses say what their budget's config key is (``budget_key``), what
    else would make one sample fit (``budget_fixes``), what the working memory is (``working_what``),
    whether the user sized their micro-batches (:meth:`budget_configured`), their state
    (:meth:`budget_state`) and the cost model (:meth:`budget_cost`)."""

    budget_key: str = ""
    budget_fixes: str = "use a smaller model or more devices"
    working_what: str = "activations"
    max_tokens: int | None = None  # the budget in force: configured, or chosen where it cuts
    budget_chosen: Budget | None = None  # by :meth:`fit_budget` when none is configured
    max_prompt_tokens: int | None = None
    horizon: int = 1
    #: whether the stage trains its model (a ``policy`` with ``gradient_checkpointing``), so that
    #: activation checkpointing can buy a larger budget
    offers_checkpointing: bool = False

    def budget_configured(self) -> bool:
        """Whether the configuration sizes the micro-batches (then nothing is chosen)."""
        raise NotImplementedError

    def budget_state(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        """What the stage holds whatever its budget (weights, optimizer state)."""
        raise NotImplementedError

    def budget_cost(self, device: str, static: float, checkpointing: bool) -> StepCost | None:
        """The cost model of one call over a micro-batch; ``None`` where the model's shape is unknown."""
        raise NotImplementedError

    def chooses_budget(self) -> bool:
        """Whether :meth:`fit_budget` would choose: no micro-batch size or token budget configured."""
        return not self.budget_configured() and not (self.max_tokens and not self.budget_chosen)

    def checkpointing_options(self) -> list[bool]:
        """Activation checkpointing settings the budget may choose between: both where the stage
        trains (``offers_checkpointing``) and its model's ``gradient_checkpointing`` is unset, else
        the one in force."""
        setting = self.policy.gradient_checkpointing if self.offers_checkpointing else False
        return [False, True] if setting is None else [bool(setting)]

    def checkpointing_in_force(self) -> bool:
        return self.offers_checkpointing and bool(self.policy.gradient_checkpointing)

    def with_working(self, device: str, parts: list[MemoryPart] | None) -> list[MemoryPart] | None:
        """``parts`` (the state) and, under a token budget (configured or chosen), the working
        memory of a call over a micro-batch of that many tokens at its peak."""
        chosen = self.budget_chosen
        tokens = chosen.tokens if chosen else self.max_tokens
        checkpointing = chosen.checkpointing if chosen else self.checkpointing_in_force()
        if parts is None or not tokens:
            return parts
        cost = self.budget_cost(device, sum(p.nbytes for p in parts), checkpointing)
        if cost is None:
            return parts
        what = f"{self.working_what} of {tokens:,} tokens ({'chosen' if chosen else self.budget_key}"
        what += ", activation checkpointing)" if checkpointing else ")"
        fix = None if chosen else f"a smaller {self.budget_key}"
        return [*parts, MemoryPart(int(cost.peak(tokens) - cost.static), what, fix, working=True)]

    def reset_budget(self) -> None:
        """Forget a budget :meth:`fit_budget` chose (a plan's memory check chooses afresh)."""
        if self.budget_chosen is not None:
            if self.budget_chosen.checkpointing_chosen:
                self.policy.gradient_checkpointing = None
            self.max_tokens, self.budget_chosen = None, None

    def fit_budget(
        self, device: str, usable: float, replicas: int, micro_batch: int
    ) -> tuple[str, str] | None:
        """Choose the token budget when the configuration sizes no micro-batch: the most tokens whose
        predicted peak, state included, fits in ``usable`` bytes (what the plan leaves this stage
        on its device), at most the ``micro_batch`` samples it receives (then nothing is cut, as
        before), with activation checkpointing where the stage offers it, the budget without it
        would be small and it is not configured. Logged. A ``(key, problem)`` when not one sample
        fits."""
        if not self.chooses_budget():
            return None
        self.reset_budget()
        parts = self.budget_state(device, replicas, micro_batch)
        if parts is None or self.max_prompt_tokens is None:
            return None
        static = sum(p.nbytes for p in parts)
        costs = {on: self.budget_cost(device, static, on) for on in self.checkpointing_options()}
        if None in costs.values():
            return None
        sample = self.max_prompt_tokens + self.horizon
        batch = micro_batch * sample
        budget = fit_tokens(self.name, self.budget_key, costs, usable, batch, sample, self.budget_fixes)
        if not isinstance(budget, Budget):
            return budget
        chosen = budget.checkpointing and not self.checkpointing_in_force()
        self.budget_chosen = dataclasses.replace(budget, checkpointing_chosen=chosen)
        if budget.tokens < batch:  # else the whole micro-batch runs at once, as before
            self.max_tokens = budget.tokens
        if chosen:
            self.policy.gradient_checkpointing = True
        return None
