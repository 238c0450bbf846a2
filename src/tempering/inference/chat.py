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
from pathlib import Path

from tempering.inference.generation import encode_prompt


def end_of_turn(tokenizer) -> tuple[str, int]:
    """The token a chat template writes right after an assistant message (`<|im_end|>`, `<end_of_turn>`,
    `<|eot_id|>`, `</s>`, ...): found by rendering one reply and reading the first special token after it.
    Without a template (or when the template writes none): EOS."""
    eos = (tokenizer.eos_token or "", tokenizer.eos_token_id)
    if not getattr(tokenizer, "chat_template", None):
        return eos
    marker = "\u2063reply\u2063"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}], tokenize=False
    )
    tail = text[text.rfind(marker) + len(marker) :].lstrip()
    for special in sorted(
        tokenizer.all_special_tokens + list(tokenizer.added_tokens_encoder), key=len, reverse=True
    ):
        if special and tail.startswith(special):
            return special, tokenizer.convert_tokens_to_ids(special)
    return eos


def stop_token_ids(tokenizer, model=None) -> tuple[int, ...]:
    """Every id that ends a generation: EOS, the chat template's end of turn, and the model's own
    `generation_config.eos_token_id` (an int or a list, e.g. Llama 3's `<|eot_id|>` beside `<|end_of_text|>`).
    `model`: a model object or its directory (the local and the vLLM engine pass what they load, so they stop
    on the same ids)."""
    ids = [tokenizer.eos_token_id, end_of_turn(tokenizer)[1]]
    extra = getattr(_generation_config(model), "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _generation_config(model):
    if not isinstance(model, str | Path):
        return getattr(model, "generation_config", None)
    if not (Path(model) / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(model)


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
        self.end_id = tokenizer.eos_token_id
        """The id that ends an action (what SFT appends, what an unfinished action is closed with)."""

    def start(self, prompt: str, tools: list[dict] | None = None) -> tuple[list[int], Conversation]:
        """The prompt text carries everything (a tool task's prompt already lists its tools)."""
        return encode_prompt(self.tokenizer, prompt), Conversation(
            [{"role": "user", "content": prompt}], tools
        )

    def observation(self, conv: Conversation, action: str, ended: bool, observation: str) -> list[int]:
        """Ids that follow an action (whose sampled ids end with EOS when `ended`) and carry `observation`."""
        return self.extend(conv, action, ended, [{"role": "user", "content": observation}])

    def extend(
        self, conv: Conversation, action: str, ended: bool, messages: list[dict[str, str]]
    ) -> list[int]:
        """`observation` for messages that follow an action: plain turns take exactly one user message."""
        if [m.get("role") for m in messages] != ["user"]:
            raise ValueError(
                "messages: this model has no chat template; one user turn follows an assistant one"
            )
        observation = messages[0]["content"]
        conv.messages += [{"role": "assistant", "content": action}, {"role": "user", "content": observation}]
        # Feedback may echo model text such as "<eos>": as text, never as a control token.
        ids = self.tokenizer(observation, add_special_tokens=False, split_special_tokens=True).input_ids
        return ids if ended else [self.end_id, *ids]

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids an episode with these turns would hold before its next action (what a server generates
        from): the first user message is the prompt, then assistant/user pairs. A leading system message
        is put before the prompt's text."""
        messages = _merge_system(messages)
        ids, conv = self.start(messages[0]["content"])
        for action, observation in zip(messages[1::2], messages[2::2]):
            action_ids = self.tokenizer(action["content"], add_special_tokens=False).input_ids
            ids += action_ids + self.observation(conv, action["content"], False, observation["content"])
        return ids


def _merge_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Plain turns: an optional system message (joined to the first user message), then user, assistant,
    user, ... ending with a user message."""
    if messages and messages[0].get("role") == "system":
        rest = messages[1:]
        if not rest:
            raise ValueError("messages: a system message needs a user message after it")
        messages = [
            {"role": "user", "content": f"{messages[0]['content']}\n\n{rest[0]['content']}"},
            *rest[1:],
        ]
    roles = [m.get("role") for m in messages]
    expected = ["user" if i % 2 == 0 else "assistant" for i in range(len(roles))]
    if not roles or roles != expected or roles[-1] != "user":
        raise ValueError(
            f"messages: this model has no chat template; it takes user and assistant turns in turn, "
            f"ending with a user turn (got {', '.join(map(str, roles)) or 'none'})"
        )
    return messages


class TemplateFormat:
    name = "template"

    def __init__(self, tokenizer, observation_role: str = "user"):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("env.chat_format=template: this tokenizer has no chat template")
        self.tokenizer, self.role = tokenizer, observation_role
        self.end_text, self.end_id = end_of_turn(tokenizer)

    def _render(self, conv: Conversation, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=conv.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def start(self, prompt: str, tools: list[dict] | None = None) -> tuple[list[int], Conversation]:
        """`tools` go to the template's own tool section (Qwen, Llama 3, Hermes templates have one)."""
        conv = Conversation([{"role": "user", "content": prompt}], tools)
        return self._ids(self._render(conv, conv.messages, True)), conv

    def observation(self, conv: Conversation, action: str, ended: bool, observation: str) -> list[int]:
        return self.extend(conv, action, ended, [{"role": self.role, "content": observation}])

    def extend(
        self, conv: Conversation, action: str, ended: bool, messages: list[dict[str, str]]
    ) -> list[int]:
        """Ids that follow an action (its sampled ids end with the end of turn when `ended`) and carry
        `messages` (observations, tool results, a user turn), up to the next generation prompt."""
        before = self._render(conv, conv.messages + [{"role": "assistant", "content": action}], False)
        conv.messages += [{"role": "assistant", "content": action}, *messages]
        after = self._render(conv, conv.messages, True)
        if not after.startswith(before):
            raise ValueError(
                "the chat template renders an earlier turn differently once a later one follows; "
                "use env.chat_format=plain"
            )
        # The sampled action ended with the end-of-turn token, already among the policy's ids; what the
        # template writes after it (e.g. a newline) belongs to the observation. Anchored on the action, so an
        # end-of-turn text earlier in the conversation cannot be taken for it.
        end = self.end_text
        at = before.rfind(action)
        if at >= 0:
            tail = before[at + len(action) :]
        else:  # the template rewrote the action (e.g. trimmed it): fall back to the last end of turn
            tail = before[before.rfind(end) + len(end) :] if end and end in before else ""
        tail = tail.removeprefix(end) if end else tail
        ids = self._ids(tail + after[len(before) :])
        return ids if ended else [self.end_id, *ids]

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation as the template renders it, with the generation prompt (what a server generates from)."""
        return self._ids(self._render(Conversation(), messages, True))


def chat_format(tokenizer, name: str = "auto", observation_role: str = "user"):
    """`auto`: the tokenizer's chat template when it has one, else plain."""
    if name == "auto":
        name = "template" if getattr(tokenizer, "chat_template", None) else "plain"
    if name == "template":
        return TemplateFormat(tokenizer, observation_role)
    if name == "plain":
        return PlainFormat(tokenizer)
    raise ValueError(f"env.chat_format: unknown format '{name}'; valid: auto, plain, template")
