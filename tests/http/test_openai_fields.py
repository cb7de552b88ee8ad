"""Every request field of OpenAI's two endpoints, taken from the `openai` package's own request
types, is either honoured or refused with a 400 naming it; none is silently ignored. A field the
package adds later fails here until the front decides its treatment."""
from __future__ import annotations

import typing

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from common.openai_http.api_errors import ApiError
from common.openai_http.request_mapping import FIELDS, HONOURED, Endpoint, map_request

WRONG_TYPE = [{}]  # no field of either schema accepts a list holding an empty object
NOT_NEUTRAL = "surely-not-neutral"  # no refused field's neutral values include it
MINIMAL = {Endpoint.COMPLETIONS: {"prompt": "x"}, Endpoint.CHAT: {"messages": [{"role": "user", "content": "x"}]}}


def schema_fields(module) -> set[str]:
    """The fields of an endpoint's request: its streaming and non-streaming forms together."""
    return {name for cls in (module.CompletionCreateParamsStreaming, module.CompletionCreateParamsNonStreaming)
            for name in typing.get_type_hints(cls)}


SCHEMAS = {Endpoint.COMPLETIONS: schema_fields(completion_create_params),
           Endpoint.CHAT: schema_fields(chat_create_params)}
CASES = [(endpoint, name) for endpoint, names in SCHEMAS.items() for name in sorted(names)]


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_every_schema_field_has_a_treatment(endpoint):
    assert len(SCHEMAS[endpoint]) > 15  # the types were read, not an empty stand-in
    assert SCHEMAS[endpoint] - set(FIELDS[endpoint]) == set()


@pytest.mark.parametrize("endpoint, name", CASES)
def test_each_field_is_read_or_refused_by_name(endpoint, name):
    """A honoured field (or an identifier for the caller's records) is read: a value of the wrong
    type is a 400 naming it. A refused field is a 400 naming it unless its value asks for nothing."""
    treatment = FIELDS[endpoint][name]
    refused_field = isinstance(treatment, tuple)
    body = {**MINIMAL[endpoint], name: NOT_NEUTRAL if refused_field else WRONG_TYPE}
    with pytest.raises(ApiError) as refused:
        map_request(endpoint, body, "m")
    assert refused.value.status == 400 and refused.value.param.startswith(name)
    for accepted in treatment if refused_field else ([] if treatment is HONOURED else ["an id"]):
        map_request(endpoint, {**MINIMAL[endpoint], name: accepted}, "m")


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_fields_outside_the_schema_are_refused_unless_served(endpoint):
    with pytest.raises(ApiError, match="unknown field 'guided_json'") as refused:
        map_request(endpoint, {**MINIMAL[endpoint], "guided_json": {}}, "m")
    assert refused.value.param == "guided_json"
    extensions = set(FIELDS[endpoint]) - SCHEMAS[endpoint]
    # num_speculative_tokens: duet's own (issue 15), a speculative node's per-request draft length.
    assert extensions <= {"top_k", "ignore_eos", "stream", "response_format", "num_speculative_tokens"}
