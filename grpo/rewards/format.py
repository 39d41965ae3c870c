"""Format rewards: the `<think>...</think>\\n<answer>...</answer>` layout, tag counts, visible reasoning steps.

All take TRL's arguments (`prompts`, `completions`, `**columns`) and accept plain or conversational completions.
"""

import dataclasses
import re
from typing import ClassVar

from .base import ConfigurableReward
from .text import completion_texts

# The seed tutorials' regex, verbatim: the think block may not contain another <think> or </think>; one newline
# separates it from the answer block, which must end the completion.
THINK_ANSWER = re.compile(r"^<think>([^<]*(?:<(?!/?think>)[^<]*)*)<\/think>\n<answer>([\s\S]*?)<\/answer>$", re.DOTALL)


def parse_think_answer(text: str) -> str | None:
    """The answer block of a well-formatted completion, or None.

    As in the seeds, a completion that does not start with `<think>` gets one prepended: the prompt is expected
    to end with the opening tag (DeepSeek-R1 style), so the model writes only the rest.
    """
    if not text.startswith("<think>"):
        text = "<think>" + text
    match = THINK_ANSWER.search(text)
    return None if match is None else match.group(2)


def think_format(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion has the layout `<think>...</think>\\n<answer>...</answer>`, else 0.0 (seeds 000/001).

    (B*G,) completions in, (B*G,) rewards out.
    """
    return [0.0 if parse_think_answer(text) is None else 1.0 for text in completion_texts(completions)]


def _count_tags(text: str) -> float:
    # open-r1 `tag_count_reward`: a quarter for each tag that appears exactly once with its newlines.
    parts = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return sum(0.25 for part in parts if text.count(part) == 1)


def tag_count(completions: list, **kwargs) -> list[float]:
    """0.25 per correctly placed tag, as open-r1's `tag_count_reward`; in [0, 1]. (B*G,) in, (B*G,) out."""
    return [_count_tags(text) for text in completion_texts(completions)]


# open-r1 `reasoning_steps_reward`. Without re.MULTILINE, `^\d+\.` matches only at the very start of the text:
# kept as upstream so that recipes written for open-r1 get the same numbers.
_STEP_MARKERS = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")


def reasoning_steps(completions: list, **kwargs) -> list[float]:
    """min(1, markers / 3): step markers ("Step 1:", bullets, "First,", ...) counted as in open-r1.

    (B*G,) in, (B*G,) out.
    """
    return [min(1.0, len(_STEP_MARKERS.findall(text)) / 3) for text in completion_texts(completions)]


# open-r1 `format_reward`, verbatim: the whole completion must be "<think>\n...\n</think>\n<answer>\n...\n</answer>"
# (re.match with DOTALL and MULTILINE, as upstream). Stricter than think_format: the newlines are required.
_R1_FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)


def r1_format(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion matches open-r1's format_reward pattern, else 0.0 (open-r1's `format`).

    (B*G,) in, (B*G,) out."""
    return [1.0 if _R1_FORMAT.match(text) else 0.0 for text in completion_texts(completions)]


@dataclasses.dataclass(frozen=True)
class CodeFormat(ConfigurableReward):
    """open-r1's `code_format`: 1.0 when the completion is `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>`
    with a ```<language> fenced block inside the answer, else 0.0. The language is the row's `language` column when
    the data has one (mixed-language training), else `language` (open-r1's code_language key; default python)."""

    name: ClassVar[str] = "code_format"
    language: str = "python"

    def __call__(self, completions: list, **kwargs) -> list[float]:
        texts = completion_texts(completions)
        languages = kwargs.get("language") or [self.language] * len(texts)
        layout = r"^<think>\n.*?\n</think>\n<answer>\n.*?```{}.*?```.*?\n</answer>$"
        return [1.0 if re.match(layout.format(re.escape(str(lang))), text, re.DOTALL | re.MULTILINE) else 0.0
                for text, lang in zip(texts, languages)]


code_format = CodeFormat()
