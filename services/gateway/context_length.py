"""A request over the model's context, in the words clients recognise.

Client libraries map OpenAI's / vLLM's wording and `code: "context_length_exceeded"` (and Anthropic's
"prompt is too long") to their context-window exception, which drives fallbacks and history trimming;
so the gateway says it that way, still naming the numbers:

- OpenAI routes (400, invalid_request_error, code context_length_exceeded): "This model's maximum context
  length is M tokens. However, you requested T tokens (P in the messages, C in the completion). Please
  reduce the length of the messages or completion."
- Anthropic route (400 invalid_request_error): "prompt is too long: P tokens > M maximum" when the prompt
  alone does not fit, else "input length and `max_tokens` exceed context limit: P + C > M, decrease input
  length or `max_tokens` and try again".

The pipeline checks before sending (it knows the verifier's max_context once one answered GetInfo);
a verifier's own refusal (its wording: verifier/rpc/server.py) is translated by `from_verifier`.
"""

from __future__ import annotations

import re

from ddtree.gateway.errors import Invalid

CODE = "context_length_exceeded"
_PROMPT_ALONE = re.compile(r"prompt has (\d+) tokens, the maximum context is (\d+)")
_PROMPT_AND_NEW = re.compile(r"prompt \((\d+)\) \+ max_new_tokens \((\d+)\) exceeds the maximum context (\d+)")


class ContextLengthExceeded(Invalid):
    """prompt_tokens + completion_tokens > max_context; str() is OpenAI's wording."""

    def __init__(self, prompt_tokens: int, completion_tokens: int, max_context: int, param: str = "messages"):
        self.prompt_tokens, self.completion_tokens, self.max_context = prompt_tokens, completion_tokens, max_context
        self.param = param
        total = prompt_tokens + completion_tokens
        super().__init__(
            f"This model's maximum context length is {max_context} tokens. However, you requested {total} tokens "
            f"({prompt_tokens} in the messages, {completion_tokens} in the completion). "
            "Please reduce the length of the messages or completion."
        )

    def anthropic_message(self) -> str:
        if self.prompt_tokens >= self.max_context:
            return f"prompt is too long: {self.prompt_tokens} tokens > {self.max_context} maximum"
        return (
            f"input length and `max_tokens` exceed context limit: {self.prompt_tokens} + {self.completion_tokens} "
            f"> {self.max_context}, decrease input length or `max_tokens` and try again"
        )


def check_context(prompt_tokens: int, completion_tokens: int, max_context: int | None, param: str) -> None:
    if max_context and prompt_tokens + completion_tokens > max_context:
        raise ContextLengthExceeded(prompt_tokens, completion_tokens, max_context, param)


def from_verifier(message: str) -> ContextLengthExceeded | None:
    """The verifier's context refusal (its own wording) as ContextLengthExceeded; None for any other message."""
    m = _PROMPT_AND_NEW.search(message)
    if m:
        return ContextLengthExceeded(int(m[1]), int(m[2]), int(m[3]))
    m = _PROMPT_ALONE.search(message)
    if m:
        return ContextLengthExceeded(int(m[1]), 0, int(m[2]))
    return None
