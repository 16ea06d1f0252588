"""How a task's problem text becomes the token ids a rollout engine generates from.

Two layers, applied in this order:

1. the task's prompt template, a string with one ``{prompt}`` placeholder for the problem (e.g.
   ``"{prompt}\\nPlease reason step by step, and put your final answer within \\boxed{}."``); other
   braces are literal, so LaTeX such as ``\\boxed{}`` needs no escaping;
2. the tokenizer's chat template, when it has one and the task asks for it: a chat checkpoint
   (Qwen2.5-Instruct, Llama-3-Instruct) answers well only inside its own turn markers, ending with
   the assistant's turn header; a base model, or the tiny character model, has no chat template
   and gets the templated text as is.

The same :class:`PromptFormat` encodes rollout prompts and evaluation prompts, so held-out accuracy
measures the policy on exactly the input it is trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLACEHOLDER = "{prompt}"


@dataclass(frozen=True)
class PromptFormat:
    """A task's prompt layout (see the module docstring).

    Args:
        template: text around the problem; ``{prompt}`` marks where the problem goes.
        chat_template: wrap the text in the tokenizer's chat template when it has one.
        system_prompt: the chat's system message (``None``: the chat template's own default).
    """

    template: str = PLACEHOLDER
    chat_template: bool = True
    system_prompt: str | None = None

    def problems(self) -> list[str]:
        """Why this format is unusable (empty when fine)."""
        if PLACEHOLDER not in self.template:
            return [f"must contain {PLACEHOLDER} where the problem text goes, got {self.template!r}"]
        return []

    def text(self, problem: str) -> str:
        """The user message: the problem inside the template."""
        return self.template.replace(PLACEHOLDER, problem)

    def uses_chat_template(self, tokenizer: Any) -> bool:
        return self.chat_template and bool(getattr(tokenizer, "chat_template", None))

    def render(self, tokenizer: Any, problem: str) -> str:
        """The full prompt string the model sees (chat turns included when they apply)."""
        text = self.text(problem)
        if not self.uses_chat_template(tokenizer):
            return text
        messages = [{"role": "user", "content": text}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, tokenizer: Any, problems: list[str]) -> list[list[int]]:
        """Token ids of each problem's prompt. The chat template writes its own special tokens
        (turn markers, a BOS where the model wants one), so none are added on top."""
        return [tokenizer(self.render(tokenizer, p), add_special_tokens=False)["input_ids"] for p in problems]


RAW = PromptFormat(chat_template=False)
"""The problem text tokenized as it is (what every format gives a tokenizer without a chat template)."""
