"""TokenBudget: what the stages that run the model over whole micro-batches share about their size.

The actor, the critic and the inference stage each cut their micro-batches by a token budget
(``workflows/padding.py``). When none is configured (nor a micro-batch size), building the plan
(``flow.memory.plan_budgets``) asks :meth:`TokenBudget.choose_budget` for the most tokens whose
predicted peak fits the bytes the stage may use on its device (``flow.budget``: its own per-token
cost model, :meth:`TokenBudget.budget_cost`), and the plan carries the answer
(``ExecutionPlan.budgets``). Choosing changes nothing: the stage takes its plan's budget when its
workers start (:meth:`TokenBudget.apply_budget`), and its :meth:`~rlinf_lightning.flow.stage.Stage.memory`
counts the peak of a budget it is given as working memory (:meth:`TokenBudget.with_working`), so
the check compares the plan's real need with the device.
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
    max_tokens: int | None = None  # the budget in force: configured, or the plan's where it cuts
    budget_applied: Budget | None = None  # the plan's, taken by :meth:`apply_budget`
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

    def configured_tokens(self) -> int | None:
        """The token budget the configuration sets (not one a plan's budget put in force)."""
        return None if self.budget_applied is not None else self.max_tokens

    def configured_checkpointing(self) -> bool | None:
        """``policy.gradient_checkpointing`` as configured (``None``: the budget may choose)."""
        if self.budget_applied is not None and self.budget_applied.checkpointing_chosen:
            return None
        return self.policy.gradient_checkpointing

    def chooses_budget(self) -> bool:
        """Whether :meth:`choose_budget` would choose: no micro-batch size or token budget configured."""
        return not self.budget_configured() and not self.configured_tokens()

    def checkpointing_options(self) -> list[bool]:
        """Activation checkpointing settings the budget may choose between: both where the stage
        trains (``offers_checkpointing``) and its model's ``gradient_checkpointing`` is unset, else
        the one in force."""
        setting = self.configured_checkpointing() if self.offers_checkpointing else False
        return [False, True] if setting is None else [bool(setting)]

    def checkpointing_configured(self) -> bool:
        return self.offers_checkpointing and bool(self.configured_checkpointing())

    def with_working(
        self, device: str, parts: list[MemoryPart] | None, budget: Budget | None = None
    ) -> list[MemoryPart] | None:
        """``parts`` (the state) and, under a token budget (``budget``, the plan's choice, else the
        configured one), the working memory of a call over a micro-batch of that many tokens at its
        peak."""
        tokens = budget.tokens if budget else self.configured_tokens()
        checkpointing = budget.checkpointing if budget else self.checkpointing_configured()
        if parts is None or not tokens:
            return parts
        cost = self.budget_cost(device, sum(p.nbytes for p in parts), checkpointing)
        if cost is None:
            return parts
        what = f"{self.working_what} of {tokens:,} tokens ({'chosen' if budget else self.budget_key}"
        what += ", activation checkpointing)" if checkpointing else ")"
        fix = None if budget else f"a smaller {self.budget_key}"
        return [*parts, MemoryPart(int(cost.peak(tokens) - cost.static), what, fix, working=True)]

    def apply_budget(self, budget: Budget | None) -> None:
        """Run under the plan's ``budget`` (``None``: the configured sizes), in place of one a
        previous plan put in force: its tokens where they cut the micro-batch, and activation
        checkpointing where the budget turned it on. What the workers start with; a check never
        calls it."""
        previous = self.budget_applied
        if previous is not None:
            if previous.checkpointing_chosen:
                self.policy.gradient_checkpointing = None
            self.max_tokens, self.budget_applied = None, None
        if budget is None:
            return
        self.budget_applied = budget
        if budget.cuts:
            self.max_tokens = budget.tokens
        if budget.checkpointing_chosen:
            self.policy.gradient_checkpointing = True

    def choose_budget(
        self, device: str, usable: float, replicas: int, micro_batch: int
    ) -> Budget | tuple[str, str] | None:
        """The token budget when the configuration sizes no micro-batch: the most tokens whose
        predicted peak, state included, fits in ``usable`` bytes (what the plan leaves this stage
        on its device), at most the ``micro_batch`` samples it receives (then nothing is cut, as
        before), with activation checkpointing where the stage offers it, the budget without it
        would be small and it is not configured. Logged. A ``(key, problem)`` when not one sample
        fits; ``None`` where nothing is chosen. Changes nothing (:meth:`apply_budget` does)."""
        if not self.chooses_budget():
            return None
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
        chosen = budget.checkpointing and not self.checkpointing_configured()
        return dataclasses.replace(budget, checkpointing_chosen=chosen, cuts=budget.tokens < batch)
