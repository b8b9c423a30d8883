"""Conversations to prompts: vLLM's ``LLM.chat`` input, checked, rendered by the chat template.

A conversation is a list of messages, each a dict with a ``"role"`` (``"system"``, ``"user"``,
``"assistant"``, ...) and a ``"content"``: a string, or a list of ``{"type": "text", "text": ...}``
parts (OpenAI's form, which vLLM accepts; only text here). ``LLM.chat`` takes one conversation or
a list of them. Each is rendered to text by the tokenizer's chat template (``tokenize=False``), then
tokenized *without* special tokens, as vLLM does: the template already wrote them, and a tokenizer
that adds a BOS of its own would otherwise double it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["PLAIN_TEMPLATE", "as_conversations", "render_chat"]

Message = Mapping[str, Any]
Conversation = Sequence[Message]

#: For a tokenizer without a chat template of its own: each message as ``role: content``.
PLAIN_TEMPLATE = (
    "{{ bos_token or '' }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _content_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ValueError(
                    f"{where}: content part {j} must be {{'type': 'text', 'text': str}} (only text is "
                    f"supported), got {part!r}"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise TypeError(f"{where}: 'content' must be a str or a list of text parts, got {type(content).__name__}")


def _check_conversation(conversation: object, where: str) -> list[dict[str, str]]:
    if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
        raise TypeError(f"{where} must be a list of message dicts, got {type(conversation).__name__}")
    if not conversation:
        raise ValueError(f"{where} is empty: give at least one message")
    checked = []
    for i, message in enumerate(conversation):
        at = f"{where}, message {i}"
        if not isinstance(message, Mapping):
            raise TypeError(f"{at} must be a dict with 'role' and 'content', got {type(message).__name__}")
        missing = [k for k in ("role", "content") if k not in message]
        if missing:
            raise ValueError(f"{at} lacks {' and '.join(repr(k) for k in missing)}")
        role = message["role"]
        if not isinstance(role, str) or not role:
            raise ValueError(f"{at}: 'role' must be a non-empty str such as 'user', got {role!r}")
        content = message["content"]
        if content is None and message.get("tool_calls"):  # an assistant's tool calls, no text (OpenAI's)
            content = ""
        checked.append({**message, "role": role, "content": _content_text(content, at)})
    return checked


def as_conversations(messages: object) -> list[list[dict[str, str]]]:
    """One conversation (a list of message dicts) or a list of conversations, checked, as a list
    of conversations. Raises ``TypeError``/``ValueError`` naming the conversation and message."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(
            "messages must be a conversation (a list of {'role', 'content'} dicts) or a list of "
            f"conversations, got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    if all(isinstance(m, Mapping) for m in messages):
        return [_check_conversation(messages, "the conversation")]
    if any(isinstance(m, Mapping) for m in messages):
        raise TypeError("messages mixes message dicts and conversations: give one kind")
    return [_check_conversation(c, f"conversation {i}") for i, c in enumerate(messages)]


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    conversation: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One checked conversation as an engine prompt ``{"prompt": text, "prompt_token_ids": ids}``.

    ``add_generation_prompt`` ends the text with the assistant's header (the model answers);
    ``continue_final_message`` leaves the last message open (the model continues it); not both.
    """
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template: pass chat_template= (a Jinja template), "
            "or use LLM.generate with a plain prompt"
        )
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    try:
        text = tokenizer.apply_chat_template(
            list(conversation),
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **dict(chat_template_kwargs or {}),
        )
    except TemplateError as err:
        which = "chat_template" if chat_template is not None else "the tokenizer's chat template"
        raise ValueError(f"{which} could not render this conversation: {type(err).__name__}: {err}") from err
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return {"prompt": text, "prompt_token_ids": ids}
