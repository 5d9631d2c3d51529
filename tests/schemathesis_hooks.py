"""A schemathesis check of this server's one refusal of schema-valid requests (tests/test_serve_openapi.py).

A JSON schema cannot say that a request's prompt (in tokens) plus its ``max_tokens`` must fit the
server's context; the document says it in words. So the run lets ``positive_data_acceptance`` see a
400 (tests/fixtures/schemathesis.toml), and this check fails any 400 to a schema-valid request but
that one: ``context_length_exceeded``.
"""

import schemathesis


@schemathesis.check
def only_context_length_refused(ctx, response, case):
    meta = case.meta
    if response.status_code != 400 or meta is None or not meta.generation.mode.is_positive:
        return None
    code = (response.json().get("error") or {}).get("code")
    if code != "context_length_exceeded":
        raise AssertionError(f"a schema-valid request was refused with 400 {code!r}: {response.text[:300]}")
    return None
