"""Completion text in either TRL format: a plain string, or a conversational list of messages."""

from typing import Any


def completion_text(completion: Any) -> str:
    """The text a reward should read.

    TRL passes a standard completion as a string and a conversational one as
    `[{"role": "assistant", "content": ...}]` (open-r1 reads `completion[0]["content"]`). With several messages (tool
    turns) the assistant's text is the concatenation of the assistant messages. A content that is a list of parts
    (`[{"type": "text", "text": ...}]`) is reduced to its text parts.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, dict)]
        if len(messages) != len(completion):
            raise TypeError("a conversational completion must be a list of {'role', 'content'} messages")
        assistant = [m for m in messages if m.get("role", "assistant") == "assistant"] or messages
        return "".join(content_text(m.get("content")) for m in assistant)
    raise TypeError(f"a completion must be a string or a list of messages, got {type(completion).__name__}")


def completion_texts(completions: list) -> list[str]:
    """`completion_text` of each completion; (B*G,) in, (B*G,) out."""
    return [completion_text(c) for c in completions]


def prompt_text(prompt: Any) -> str:
    """A prompt's text: the string itself, or its messages' contents, one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(content_text(message.get("content")) for message in prompt)


def content_text(content: Any) -> str:
    """The text of one message's `content` (a string, None, or a list of typed parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise TypeError(f"message content must be a string or a list of parts, got {type(content).__name__}")
