"""The prompt of a GenerateRequest as token ids: given directly, as text, or as chat messages."""
from __future__ import annotations

from common.errors import InvalidArgument
from common.model.tokenizer import Tokenizer
from common.serving.chat_prompt import template_inputs
from protos.duet.v1 import duet_pb2 as pb

MAX_PROMPT_TEXT_CHARS = 1_000_000


def prompt_token_ids(request: pb.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    given = [name for name in ("token_ids", "prompt", "messages") if getattr(request, name)]
    if len(given) != 1:
        raise InvalidArgument(f"set exactly one of token_ids, prompt, messages (got {given or 'none'})")
    if request.tools and not request.messages:
        raise InvalidArgument("tools are rendered with chat messages: send messages, not prompt or token_ids")
    if request.token_ids:
        return list(request.token_ids)
    if request.prompt:
        if len(request.prompt) > MAX_PROMPT_TEXT_CHARS:
            raise InvalidArgument(f"prompt is longer than {MAX_PROMPT_TEXT_CHARS} characters")
        return tokenizer.encode(request.prompt)
    size = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in request.messages)
    if size + sum(len(t.description) + len(t.parameters) for t in request.tools) > MAX_PROMPT_TEXT_CHARS:
        raise InvalidArgument(f"messages and tools are longer than {MAX_PROMPT_TEXT_CHARS} characters")
    try:
        takes_tools = tokenizer.takes_tools  # parses the template: a model's template may not parse
    except Exception as exc:
        raise InvalidArgument(f"the model's chat template does not parse: {exc}") from None
    messages, tools = template_inputs(request, takes_tools)
    try:
        return tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools))
    except Exception as exc:  # the template itself may raise on malformed conversations
        raise InvalidArgument(f"messages could not be rendered with the chat template: {exc}") from None
