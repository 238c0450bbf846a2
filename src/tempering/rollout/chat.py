"""How an episode's text becomes tokens: the prompt, then (action, observation) turns.

Two formats. `template` renders the conversation with the tokenizer's own chat template (a model that
has one was trained on it): the prompt is a user message, each action an assistant message, each
observation a user message. `plain` is for the tiny default model, which has no template: the prompt is
the task text after BOS, an action ends with EOS, an observation is its text as is.

Actions are never re-tokenized: the trained sequence holds exactly the ids the policy sampled, and an
observation is the tokens between the end of one action and the start of the next generation - for a
template, the difference between the rendered conversation before and after the observation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tempering.rollout.generate import encode_prompt


@dataclass
class Conversation:
    """The messages of one episode so far (what a chat template renders)."""

    messages: list[dict[str, str]] = field(default_factory=list)
    tools: list[dict] | None = None
    """Tool declarations ({"type": "function", "function": JSON schema}) the template renders."""


class PlainFormat:
    name = "plain"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def start(self, prompt: str, tools: list[dict] | None = None) -> tuple[list[int], Conversation]:
        """The prompt text carries everything (a tool task's prompt already lists its tools)."""
        return encode_prompt(self.tokenizer, prompt), Conversation([{"role": "user", "content": prompt}], tools)

    def observation(self, conv: Conversation, action: str, ended: bool, observation: str) -> list[int]:
        """Ids that follow an action (whose sampled ids end with EOS when `ended`) and carry `observation`."""
        conv.messages += [{"role": "assistant", "content": action}, {"role": "user", "content": observation}]
        # Feedback may echo model text such as "<eos>": as text, never as a control token.
        ids = self.tokenizer(observation, add_special_tokens=False, split_special_tokens=True).input_ids
        return ids if ended else [self.tokenizer.eos_token_id, *ids]


class TemplateFormat:
    name = "template"

    def __init__(self, tokenizer, observation_role: str = "user"):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("env.chat_format=template: this tokenizer has no chat template")
        self.tokenizer, self.role = tokenizer, observation_role

    def _render(self, conv: Conversation, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=conv.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def start(self, prompt: str, tools: list[dict] | None = None) -> tuple[list[int], Conversation]:
        """`tools` go to the template's own tool section (Qwen, Llama 3, Hermes templates have one)."""
        conv = Conversation([{"role": "user", "content": prompt}], tools)
        return self._ids(self._render(conv, conv.messages, True)), conv

    def observation(self, conv: Conversation, action: str, ended: bool, observation: str) -> list[int]:
        before = self._render(conv, conv.messages + [{"role": "assistant", "content": action}], False)
        conv.messages += [{"role": "assistant", "content": action}, {"role": self.role, "content": observation}]
        after = self._render(conv, conv.messages, True)
        if not after.startswith(before):
            raise ValueError("the chat template renders an earlier turn differently once a later one follows; "
                             "use env.chat_format=plain")
        # The sampled action ended with EOS, already among the policy's ids; what the template writes after
        # the action (its end-of-turn, often EOS itself, then e.g. a newline) belongs to the observation.
        # Anchored on the action, so an EOS text earlier in the conversation cannot be taken for it.
        eos = self.tokenizer.eos_token or ""
        at = before.rfind(action)
        if at >= 0:
            tail = before[at + len(action):]
        else:  # the template rewrote the action (e.g. trimmed it): fall back to the last EOS
            tail = before[before.rfind(eos) + len(eos):] if eos and eos in before else ""
        tail = tail.removeprefix(eos) if eos else tail
        ids = self._ids(tail + after[len(before):])
        return ids if ended else [self.tokenizer.eos_token_id, *ids]


def chat_format(tokenizer, name: str = "auto", observation_role: str = "user"):
    """`auto`: the tokenizer's chat template when it has one, else plain."""
    if name == "auto":
        name = "template" if getattr(tokenizer, "chat_template", None) else "plain"
    if name == "template":
        return TemplateFormat(tokenizer, observation_role)
    if name == "plain":
        return PlainFormat(tokenizer)
    raise ValueError(f"env.chat_format: unknown format '{name}'; valid: auto, plain, template")
