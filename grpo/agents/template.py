"""The chat template's tool-response markup, as the token ids appended after a model turn that called tools.

A trajectory's token ids are never re-tokenized from its text: re-tokenizing a whole conversation can merge or
split tokens across a boundary and so change tokens the model already sampled (and their log-probs). The model's own
ids are kept verbatim and only the template's new text is tokenized: the tool messages rendered after a short
conversation that ends with an assistant turn, minus that conversation (TRL 1.16's `_get_tool_suffix_ids` does the
same). The cut is made after the end-of-turn token, which must be the tokenizer's EOS: that is where the model's
turn ended, since the rollout engine stops on EOS.

For Qwen2.5's template, after "...</tool_call><|im_end|>" (the model's turn) the suffix of one tool answer is

    "\\n<|im_start|>user\\n<tool_response>\\n6\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"
"""

from __future__ import annotations

from grpo.config import ConfigError


class ToolTemplate:
    """Renders tool messages into suffix token ids with `tokenizer`'s chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError("tools: tool calling needs a chat template that renders tool calls and tool messages "
                              "(e.g. Qwen2.5's); the tokenizer has no chat template. Of the shipped models "
                              "tiny-tools has one (model_name_or_path=tiny-tools, as recipes/calculator_tools.yaml "
                              "sets), tiny-arith (the default) does not.")
        probe = "7c1f3e tool answer"
        try:
            ids = self._render([{"role": "tool", "name": "probe", "content": probe}], "probe")
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - a template raises its own errors (jinja, raise_exception)
            raise ConfigError(f"tools: the tokenizer's chat template cannot render a tool message ({err}); use a "
                              "template with tool support (e.g. Qwen2.5's).") from None
        if probe not in self.tokenizer.decode(ids, skip_special_tokens=False):
            raise ConfigError("tools: the tokenizer's chat template drops tool messages; use a template with tool "
                              "support (e.g. Qwen2.5's).")

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """Token ids of `tool_messages` (role "tool", with name and content) and the next assistant header."""
        return self._render(tool_messages, tool_messages[0].get("name") or "tool")

    def _render(self, tool_messages: list[dict], name: str) -> list[int]:
        # The real tool name in the preceding call: some templates (GPT-OSS) take the response header from it.
        before = [{"role": "user", "content": "x"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": name, "arguments": {}}}]}]
        prefix = self._ids(before, generation_prompt=False)
        full = self._ids(before + tool_messages, generation_prompt=True)
        eos = self.tokenizer.eos_token_id
        ends = [i for i, token in enumerate(prefix) if token == eos]
        if not ends:
            raise ConfigError("tools: the chat template does not end an assistant turn with the EOS token "
                              f"({self.tokenizer.eos_token!r}), where the model's turns end; set the tokenizer's "
                              "eos_token to the template's end-of-turn token (e.g. <|im_end|> for Qwen2.5).")
        prefix = prefix[:ends[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise ConfigError("tools: the chat template renders the conversation before a tool message differently "
                              "once the tool message follows; its tool answers cannot be appended token-exactly.")
        return full[len(prefix):]

    def _ids(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
