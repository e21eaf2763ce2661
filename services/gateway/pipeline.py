"""Request preparation both public channels share (gRPC `server.py`, HTTP `http.py`): validate (a
ValueError naming the field), render the chat template, tokenize, and build the verifier request (a
`Job`; the GenerateRequest itself: job_request.py); `Pipeline.generate` then runs it as a `generation.Generation`.

- Stop tokens: the request's stop_token_ids plus `<|im_end|>`, `[EOS]` and the tokenizer's eos token
  (unless ignore_eos).
- Limits: max_tokens (one cap: the verifier's max_new_tokens_limit, `max_tokens_limit`), prompt
  characters (max_prompt_chars), prompt tokens (max_prompt_tokens), stop strings and stop ids (counts and
  lengths below), prompt + max_tokens within the verifier's max_context (context_length.py's wording).
- truncate_prompt_tokens (vLLM's): only the prompt's last k tokens go on (-1: the maximum context),
  cut before the limits on prompt tokens and context are checked.
- Chat output goes through the reasoning parser (config.reasoning_parser, unless the request turns
  separate_reasoning off) and, when the request declares tools (and tool_choice is not "none"), the
  tool-call parser (config.tool_call_parser); finish_reason "stop" becomes "tool_calls" when calls
  were parsed. Completions return raw text.
- Text: special tokens are skipped (unless skip_special_tokens is false) but for the parsers' markers;
  min_p and min_tokens go to the verifier's sampler (SamplingParams), which applies them per tree node,
  and so do the penalties and logit masks (bad_words tokenized here, bad_words.py), per tree node with the
  node's own path counted, losslessly.
- continue_final_message: the prompt is cut right after the final assistant message's content.
- Structured outputs: options.grammar (an llguidance grammar; the HTTP API compiles response_format and
  the guided fields into it, structured_outputs.py) or tool_choice required / function:NAME (a forced
  Kimi K2 tool-call section) go to the verifier as GenerateRequest.grammar; after a prompt that opened a
  think block the constraint starts at `</think>`. Each grammar is checked once: a raw gRPC
  options.grammar here (check_client_grammar), the HTTP fields by structured_outputs, the tool-call
  grammar by tool_grammar. min_tokens > 0 with a grammar is refused (a finished grammar allows only
  the stop ids, which min_tokens masks).
"""

from __future__ import annotations

import dataclasses
import uuid

import grpc

from ddtree.config import GatewayConfig
from ddtree.contract.request_params import MAX_LOGIT_BIAS, check_wire
from ddtree.gateway.auth import ApiKeys
from ddtree.gateway.bad_words import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, bad_word_ids
from ddtree.gateway.context_length import check_context
from ddtree.gateway.errors import Invalid, RequestError
from ddtree.gateway.generation import Generation, Result, StopMatcher
from ddtree.gateway.job_request import verifier_request
from ddtree.gateway.parsers.kimi_k2_reasoning import starts_in_reasoning
from ddtree.gateway.parsers.registry import check_names
from ddtree.gateway.routing import Router
from ddtree.gateway.structured_outputs import after_reasoning, auto_tool_grammar, check_grammar, tool_grammar
from ddtree.protocol.ddtree.v1 import gateway_pb2, verifier_pb2
from ddtree.tokenization.chat_template import text_chars, validate_messages, validate_tools
from ddtree.tokenization.tokenizer import Tokenizer

__all__ = [
    "Generation",
    "Invalid",
    "Job",
    "Pipeline",
    "RequestError",
    "Result",
    "StopMatcher",
    "validate_options",
    "validate_template_kwargs",
]

EOS_TOKENS = ("<|im_end|>", "[EOS]")
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 64
INFO_TIMEOUT_S = 1.0
TOOL_CHOICES = ("auto", "none", "required")  # or "function:NAME": a call of that tool


@dataclasses.dataclass(frozen=True)
class Job:
    """A validated request, ready to send to a verifier."""

    request: verifier_pb2.GenerateRequest
    stop_strings: tuple[str, ...]
    stop_ids: frozenset[int]
    api: str = "complete"  # chat | complete
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    in_reasoning: bool = False  # the prompt opened a think block
    tool_index_offset: int = 0  # tool calls earlier in the conversation
    skip_special: bool = True  # special ids are not rendered, except the markers the active parsers read
    include_stop_str: bool = False  # a matched stop string stays in the text
    min_tokens: int = 0  # stop strings are looked for only after this many tokens (the verifier masks stop ids)


def validate_options(
    o: gateway_pb2.GenerationOptions,
    *,
    vocab_size: int,
    max_tokens_limit: int | None,
    prefix: str = "options.",
    max_budget: int | None = None,
) -> None:
    """Raise Invalid (a ValueError) naming the first bad field of GenerationOptions. `max_budget`: the
    caller's cap on the tree budget (the server's, or its API key's)."""
    if o.max_tokens < 0:
        raise Invalid(f"{prefix}max_tokens: must be >= 0 (0 = server default), got {o.max_tokens}")
    if max_tokens_limit is not None and o.max_tokens > max_tokens_limit:
        raise Invalid(f"{prefix}max_tokens: must be <= {max_tokens_limit}, got {o.max_tokens}")
    check_wire(o, prefix, Invalid)  # temperature, top_p, top_k, min_p, min_tokens, penalties, budget, logprobs
    if o.max_tokens and o.min_tokens > o.max_tokens:
        raise Invalid(f"{prefix}min_tokens: must be <= max_tokens ({o.max_tokens}), got {o.min_tokens}")
    if max_budget is not None and o.budget > max_budget:
        raise Invalid(f"{prefix}budget: must be <= {max_budget} (this server's or this API key's cap), got {o.budget}")
    if len(o.stop) > MAX_STOP_STRINGS:
        raise Invalid(f"{prefix}stop: at most {MAX_STOP_STRINGS} stop strings, got {len(o.stop)}")
    for i, s in enumerate(o.stop):
        if not s:
            raise Invalid(f"{prefix}stop[{i}]: must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise Invalid(f"{prefix}stop[{i}]: {len(s)} characters, over the limit of {MAX_STOP_CHARS}")
    if len(o.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise Invalid(f"{prefix}stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(o.stop_token_ids)}")
    for i, t in enumerate(o.stop_token_ids):
        if not 0 <= t < vocab_size:
            raise Invalid(f"{prefix}stop_token_ids[{i}]: token id {t} is outside the vocabulary (size {vocab_size})")
    _validate_logit_masks(o, vocab_size, prefix)


def _validate_logit_masks(o: gateway_pb2.GenerationOptions, vocab_size: int, prefix: str) -> None:
    """Logit masks: OpenAI's / vLLM's ranges, token ids in the vocabulary (the penalties: check_wire)."""
    for token, bias in o.logit_bias.items():
        if not 0 <= token < vocab_size:
            raise Invalid(f"{prefix}logit_bias: token id {token} is outside the vocabulary (size {vocab_size})")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise Invalid(f"{prefix}logit_bias.{token}: must be in [-100, 100], got {bias}")
    for i, t in enumerate(o.allowed_token_ids):
        if not 0 <= t < vocab_size:
            raise Invalid(f"{prefix}allowed_token_ids[{i}]: token id {t} is outside the vocabulary (size {vocab_size})")
    if len(o.bad_words) > MAX_BAD_WORDS:
        raise Invalid(f"{prefix}bad_words: at most {MAX_BAD_WORDS} words, got {len(o.bad_words)}")
    for i, word in enumerate(o.bad_words):
        if not word.strip():
            raise Invalid(f"{prefix}bad_words[{i}]: must not be empty or only whitespace")
        if len(word) > MAX_STOP_CHARS:
            raise Invalid(f"{prefix}bad_words[{i}]: {len(word)} characters, over the limit of {MAX_STOP_CHARS}")


def validate_template_kwargs(kwargs) -> dict:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise Invalid(f"chat_template_kwargs: must be a JSON object, got {type(kwargs).__name__}")
    for key in ("thinking", "preserve_thinking"):
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise Invalid(f"chat_template_kwargs.{key}: must be true or false, got {kwargs[key]!r}")
    return kwargs


class Pipeline:
    """Everything between a parsed public request and the verifier: thread-safe, one per gateway."""

    def __init__(self, tokenizer: Tokenizer, router: Router, config: GatewayConfig, keys: ApiKeys | None = None):
        check_names(config.reasoning_parser, config.tool_call_parser)
        self.keys = keys or ApiKeys.from_config(config)  # who may call, and each key's budget cap
        self.tokenizer = tokenizer
        self.router = router
        self.config = config
        eos = [t for t in EOS_TOKENS if t in tokenizer.special_tokens]
        self._eos_ids = tuple(
            dict.fromkeys(
                [
                    *(tokenizer.special_tokens[t] for t in eos),
                    *(() if tokenizer.eos_id is None else (tokenizer.eos_id,)),
                ]
            )
        )
        self._max_context: int | None = None
        self._max_new_tokens: int | None = None  # the verifier's max_new_tokens_limit (0 unknown: None)

    # -- request preparation -----------------------------------------------------------------------
    def chat_job(
        self,
        messages: list[dict],
        options: gateway_pb2.GenerationOptions,
        *,
        tools=None,
        chat_template_kwargs: dict | None = None,
        request_id: str = "",
        tool_choice: str = "auto",
        separate_reasoning: bool = True,
        options_prefix: str = "options.",
        max_budget: int | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        grammar_checked: bool = False,
        parallel_tool_calls: bool = True,
    ) -> Job:
        """A chat request as a Job. `messages` are OpenAI-style dicts (chat_template.py).
        parallel_tool_calls false: at most one tool call (the tool-call grammar's section holds one).
        continue_final_message: the prompt ends inside the last (assistant) message, which the answer
        continues (vLLM's and HF's rule: the rendered text is cut right after that message's content).
        grammar_checked: options.grammar was compiled and checked by the caller (the HTTP API's
        structured_outputs.request_grammar, field by field), so it is not checked again here."""
        if not messages:
            raise Invalid("messages: must not be empty")
        if tool_choice not in TOOL_CHOICES and not tool_choice.startswith("function:"):
            raise Invalid(
                f"tool_choice: must be one of {', '.join(TOOL_CHOICES)} or function:NAME, got {tool_choice!r}"
            )
        tools = validate_tools(tools)
        forced = self._forced_tool_grammar(tools, tool_choice, options.grammar, parallel_tool_calls)
        auto = "" if forced else self._auto_tool_grammar(tools, tool_choice, options.grammar, parallel_tool_calls)
        if not grammar_checked:
            self.check_client_grammar(options, options_prefix)
        if tool_choice == "none":
            tools = None  # the model is not told about tools, and nothing is parsed as a call
        kwargs = validate_template_kwargs(chat_template_kwargs)
        validate_messages(messages)  # counts and types first: cheap, and the clearest message
        # Every string the template may print (content, names, ids, arguments, tool declarations),
        # counted before rendering; the rendered prompt is checked again after.
        self.check_prompt_chars(text_chars(messages) + text_chars(tools) + text_chars(kwargs), "messages and tools")
        if continue_final_message and add_generation_prompt:
            raise Invalid("continue_final_message: cannot be true while add_generation_prompt is true")
        prompt, input_ids = self.render(messages, tools, add_generation_prompt, kwargs)
        if continue_final_message:
            prompt, input_ids = self._cut_after_final(messages[-1], prompt, input_ids)
        history_calls = sum(len(m.get("tool_calls") or ()) for m in messages)
        reasoning = self.config.reasoning_parser if separate_reasoning else "none"
        tool_parser = self.config.tool_call_parser if tools else "none"
        grammar = forced or auto or options.grammar
        if grammar and starts_in_reasoning(prompt) and (reasoning != "none" or auto):
            # the constraint starts after </think> (always for auto's: </think> is no text the grammar allows)
            field = "tool_choice" if forced else "tools" if auto else f"{options_prefix}grammar"
            grammar = after_reasoning(grammar, self.tokenizer, field)
        return self._job(
            options,
            request_id,
            input_ids,
            options_prefix,
            api="chat",
            reasoning_parser=None if reasoning == "none" else reasoning,
            tool_parser=None if tool_parser == "none" else tool_parser,
            in_reasoning=starts_in_reasoning(prompt),
            tool_index_offset=history_calls,
            max_budget=max_budget,
            grammar=grammar,
            open_grammar=bool(auto),
        )

    def _auto_tool_grammar(self, tools, tool_choice: str, grammar: str, parallel: bool) -> str:
        """tool_choice auto with tools: a grammar whose tool-call section names declared tools only
        (structured_outputs.auto_tool_grammar), or "" (no tools, another constraint, or another parser)."""
        if tool_choice != "auto" or not tools or grammar:
            return ""
        if self.config.tool_call_parser != "kimi_k2":
            if not parallel:
                raise Invalid(
                    "parallel_tool_calls: false needs the kimi_k2 tool-call parser, "
                    f"not {self.config.tool_call_parser!r}"
                )
            return ""
        return auto_tool_grammar(tools, self.tokenizer, parallel)

    def _forced_tool_grammar(self, tools, tool_choice: str, grammar: str, parallel: bool = True) -> str:
        """tool_choice required / function:NAME as a grammar of the tool-call section, or ""."""
        if tool_choice in ("auto", "none"):
            return ""
        if not tools:
            raise Invalid(f"tool_choice: {tool_choice!r} needs tools")
        if grammar:
            raise Invalid("tool_choice: a forced tool call cannot be combined with a structured output format")
        if self.config.tool_call_parser != "kimi_k2":
            raise Invalid(
                f"tool_choice: forced tool calls need the kimi_k2 tool-call parser, not {self.config.tool_call_parser!r}"
            )
        name = tool_choice.removeprefix("function:") if tool_choice.startswith("function:") else None
        return tool_grammar(tools, name, self.tokenizer, parallel)

    def complete_job(
        self,
        prompt: str | list[int],
        options: gateway_pb2.GenerationOptions,
        request_id: str = "",
        options_prefix: str = "options.",
        max_budget: int | None = None,
        grammar_checked: bool = False,
    ) -> Job:
        """A completion of `prompt` (text, or token ids; special-token strings in the text are special
        ids: a completion's prompt is the client's whole input, with no structure to forge).
        grammar_checked: as for chat_job."""
        if not prompt:
            raise Invalid("prompt: must not be empty")
        if not grammar_checked:
            self.check_client_grammar(options, options_prefix)
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            try:
                self.tokenizer.check_ids(ids)
            except ValueError as e:
                raise Invalid(f"prompt: {e}") from None
        return self._job(options, request_id, ids, options_prefix, max_budget=max_budget)

    def render(self, messages: list[dict], tools, add_generation_prompt: bool, kwargs: dict) -> tuple[str, list[int]]:
        """The rendered chat prompt and its ids: request text encoded as plain text, the template's
        structure tokens special (`Tokenizer.encode_chat`), unless the deployment set
        --allow-special-tokens-in-content."""
        prompt, ids = self.tokenizer.encode_chat(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=kwargs,
            allow_special_in_content=self.config.allow_special_tokens_in_content,
        )
        self.check_prompt_chars(len(prompt), "rendered chat prompt")
        return prompt, ids

    def _cut_after_final(self, final: dict, prompt: str, ids: list[int]) -> tuple[str, list[int]]:
        """The rendered chat cut right after the final message's content: the special tokens the
        template puts after it (end of turn) are dropped from both the text and the ids."""
        if final.get("role") != "assistant":
            raise Invalid("continue_final_message: the last message must be the assistant's")
        content = final.get("content") or ""
        core = content.strip()
        at = prompt.rfind(core) if core else -1
        if at < 0:
            raise Invalid("continue_final_message: the final message's content does not appear in the rendered prompt")
        end = at + (len(content.lstrip()) if prompt.startswith(content.lstrip(), at) else len(core))
        tail, ids = prompt[end:], list(ids)
        while tail and ids and self.tokenizer.is_special(ids[-1]):
            name = self.tokenizer.id_to_token(ids[-1])
            if not tail.endswith(name):
                break
            tail, ids = tail[: -len(name)], ids[:-1]
        if tail:
            raise Invalid(f"continue_final_message: the template adds text after the final message ({tail!r})")
        return prompt[:end], ids

    @staticmethod
    def check_client_grammar(o: gateway_pb2.GenerationOptions, prefix: str) -> None:
        """Invalid naming `{prefix}grammar` when the client's raw grammar does not compile (the one
        check of it: after_reasoning and the verifier take it as checked)."""
        if o.grammar:
            check_grammar(o.grammar, f"{prefix}grammar")

    def check_prompt_chars(self, n: int, what: str) -> None:
        if n > self.config.max_prompt_chars:
            raise Invalid(f"{what}: {n} characters, over the limit of {self.config.max_prompt_chars}")

    def _job(
        self,
        o: gateway_pb2.GenerationOptions,
        request_id: str,
        input_ids: list[int],
        prefix: str,
        max_budget: int | None = None,
        grammar: str | None = None,
        open_grammar: bool = False,
        **kwargs,
    ) -> Job:
        """open_grammar: the grammar never ends by itself (auto tool calls), so min_tokens stays possible."""
        validate_options(
            o,
            vocab_size=self.tokenizer.vocab_size,
            max_tokens_limit=self.max_tokens_limit(),
            prefix=prefix,
            max_budget=self.config.max_budget if max_budget is None else max_budget,
        )
        if not input_ids:
            raise Invalid("prompt: encodes to no tokens")
        if o.HasField("truncate_prompt_tokens"):
            input_ids = self._truncated(input_ids, o.truncate_prompt_tokens, prefix)
        limit = self.config.max_prompt_tokens
        if limit and len(input_ids) > limit:
            raise Invalid(f"prompt: {len(input_ids)} tokens, over the limit of {limit}")
        stop_ids = list(dict.fromkeys([*o.stop_token_ids, *(() if o.ignore_eos else self._eos_ids)]))
        bad_words = bad_word_ids(self.tokenizer, o.bad_words)
        if any(len(w.ids) > MAX_BAD_WORD_TOKENS for w in bad_words):
            raise Invalid(f"{prefix}bad_words: a word is over {MAX_BAD_WORD_TOKENS} tokens long")
        max_new = o.max_tokens or self.default_max_tokens(len(input_ids))
        if self.router is not None:
            self.max_context()  # the verifier's, once one answered (None before: it checks the request itself)
            param = "messages" if kwargs.get("api") == "chat" else "prompt"
            check_context(len(input_ids), max_new, self._max_context, param)
        if o.min_tokens > max_new:
            raise Invalid(f"{prefix}min_tokens: must be <= max_tokens ({max_new}, the default), got {o.min_tokens}")
        request = verifier_request(
            o,
            request_id=request_id or f"gw-{uuid.uuid4().hex}",
            input_ids=input_ids,
            max_new_tokens=max_new,
            stop_token_ids=stop_ids,
            bad_words=bad_words,
            grammar=o.grammar if grammar is None else grammar,  # checked before (check_client_grammar)
        )
        if request.grammar and o.min_tokens and not open_grammar:
            # A finished grammar allows only the stop ids, which min_tokens masks: no token would be left.
            raise Invalid(
                f"{prefix}min_tokens: must be 0 with a structured output or a forced tool call, got {o.min_tokens}"
            )
        return Job(
            request=request,
            stop_strings=tuple(o.stop),
            stop_ids=frozenset(stop_ids),
            skip_special=o.skip_special_tokens if o.HasField("skip_special_tokens") else True,
            include_stop_str=o.include_stop_str_in_output,
            min_tokens=o.min_tokens,
            **kwargs,
        )

    def _truncated(self, input_ids: list[int], k: int, prefix: str) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens; -1 = the model's maximum context,
        and more than that is refused (vLLM's rule)."""
        context = (self.max_context() if self.router is not None else 0) or self.tokenizer.model_max_length or 0
        k = context if k == -1 else k
        if k == 0:
            raise Invalid(f"{prefix}truncate_prompt_tokens: 0 would leave no prompt (-1 = the maximum context)")
        if context and k > context:
            raise Invalid(f"{prefix}truncate_prompt_tokens: must be <= the maximum context ({context}), got {k}")
        return input_ids[-k:] if k > 0 else input_ids

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """max_tokens for a request that sets none: --default-max-tokens, or the room the context leaves
        after the prompt when that is less (a long prompt is not refused for a default it never chose)."""
        cap = self.max_tokens_limit()
        limit = min(self.config.default_max_tokens, cap or self.config.default_max_tokens)
        context = self.max_context() if self.router is not None else 0
        if context and 0 < context - prompt_tokens < limit:
            return context - prompt_tokens
        return limit

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, job: Job, timeout: float | None = None, protocol: str = "grpc") -> Generation:
        return Generation(job, self.tokenizer, self.router, timeout, protocol)

    def max_tokens_limit(self) -> int | None:
        """The one cap on max_tokens: the verifier's --max-new-tokens-limit, once a verifier answered
        GetInfo (None before, and without verifiers: the verifier checks the request itself)."""
        if self.router is not None:
            self.max_context()
        return self._max_new_tokens

    def max_context(self) -> int:
        """A verifier's max_context, asked once one answers; the tokenizer's limit until then."""
        if self._max_context is None:
            try:
                info = self.router.first_healthy().stub.GetInfo(
                    verifier_pb2.VerifierInfoRequest(), timeout=INFO_TIMEOUT_S
                )
                self._max_context = info.max_context
                self._max_new_tokens = info.max_new_tokens_limit or None
            except grpc.RpcError:
                return self.tokenizer.model_max_length or 0
        return self._max_context
