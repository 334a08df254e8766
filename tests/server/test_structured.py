"""``response_format`` (grammar-constrained decoding) and ``logit_bias`` through the official
`openai` client, on the tiny random model: whatever it samples, a constrained answer is JSON
that matches its schema, and rows without a constraint give the tokens they give alone."""

import concurrent.futures
import json
import time

import jsonschema_rs
import openai
import pytest
from server_support import CONFIG

from lowbit.models import Sampling, generate_tokens

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}
# Long enough for any answer SCHEMA admits.
MAX_TOKENS = 48


def _client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _completion(base_url, **kwargs):
    args = dict(model="tiny", prompt="Answer in JSON:", max_tokens=MAX_TOKENS)
    args.update(kwargs)
    return _client(base_url).completions.create(**args).choices[0]


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_sampled_answers_match_the_schema(base_url, seed):
    choice = _completion(
        base_url, temperature=1.0, seed=seed, extra_body={"response_format": JSON_SCHEMA}
    )
    assert choice.finish_reason == "stop"
    jsonschema_rs.validate(SCHEMA, json.loads(choice.text))


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_chat_answers_match_the_schema_streamed_and_not(base_url, stream):
    client = _client(base_url)
    args = dict(
        model="tiny",
        messages=[{"role": "user", "content": "pick a colour"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=JSON_SCHEMA,
    )
    if stream:
        chunks = list(client.chat.completions.create(**args, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.chat.completions.create(**args).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert finish == "stop"
    jsonschema_rs.validate(SCHEMA, json.loads(text))


def test_each_of_n_sampled_choices_matches_the_schema_and_logprobs_come_along(base_url):
    """n choices each follow the grammar with a matcher of their own; logprobs and penalties
    ride along on the same rows."""
    r = _client(base_url).completions.create(
        model="tiny",
        prompt="Answer in JSON:",
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=7,
        n=3,
        logprobs=2,
        presence_penalty=0.5,
        extra_body={"response_format": JSON_SCHEMA},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema_rs.validate(SCHEMA, json.loads(choice.text))
        assert len(choice.logprobs.tokens) >= 1


def test_json_object_answers_are_objects(base_url):
    stopped = 0
    for seed in range(6):
        choice = _completion(
            base_url,
            prompt="Answer:",
            max_tokens=100,
            temperature=1.0,
            seed=seed,
            extra_body={"response_format": {"type": "json_object"}},
        )
        assert choice.text.startswith("{")
        if choice.finish_reason == "stop":  # a random model's strings may run past max_tokens
            assert isinstance(json.loads(choice.text), dict)
            stopped += 1
    assert stopped >= 1
    # A bias toward "}" (it is masked where the grammar forbids it) closes the object at once.
    close = str(ord("}"))  # the tiny vocabulary: one token per byte
    choice = _completion(
        base_url,
        temperature=1.0,
        seed=0,
        extra_body={"response_format": {"type": "json_object"}, "logit_bias": {close: 100}},
    )
    assert (choice.text, choice.finish_reason) == ("{}", "stop")


def _token_ids(base_url, **extra):
    choice = _completion(
        base_url, temperature=0, max_tokens=6, extra_body=extra | {"return_token_ids": True}
    )
    return choice.model_extra["token_ids"]


def test_logit_bias_bans_and_forces_tokens(base_url):
    plain = _token_ids(base_url)
    banned = _token_ids(base_url, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    forced = ord("q")
    assert _token_ids(base_url, logit_bias={str(forced): 100}) == [forced] * 6


@pytest.mark.parametrize(
    "response_format, param",
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"pattern": "(("}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x"}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {}}},
            "response_format.json_schema.name",
        ),
        ({"type": "yaml"}, "response_format.type"),
    ],
)
def test_a_bad_response_format_gets_a_400_naming_the_path(base_url, response_format, param):
    with pytest.raises(openai.BadRequestError) as err:
        _completion(base_url, extra_body={"response_format": response_format})
    assert err.value.body["param"] == param
    assert err.value.body["message"].startswith(param)


def test_a_giant_schema_is_refused(base_url):
    properties = {f"field_{i}": {"type": "string", "maxLength": 10} for i in range(2000)}
    schema = {"type": "object", "properties": properties}
    with pytest.raises(openai.BadRequestError, match="at most"):
        _completion(
            base_url,
            extra_body={
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "big", "schema": schema},
                }
            },
        )


@pytest.mark.parametrize(
    "logit_bias", [{"x": 1}, {"99999": 1}, {"5": 101}, {"5": True}, {"5": "1"}, [1]]
)
def test_a_bad_logit_bias_gets_a_400(base_url, logit_bias):
    with pytest.raises(openai.BadRequestError) as err:
        _completion(base_url, extra_body={"logit_bias": logit_bias})
    assert err.value.body["param"] == "logit_bias"


def test_unconstrained_rows_are_unaffected_by_constrained_ones(base_url, loaded, served):
    prompt = loaded.tokenizer.encode("The quick brown fox").ids
    n = 40
    expected = generate_tokens(
        loaded.model,
        [prompt],
        max_new_tokens=n,
        sampling=Sampling(0.9, None, 1.0),
        key=11,
        stop_ids=sorted(served.stop_ids),
    ).tokens[0]

    def plain():
        choice = _completion(
            base_url,
            prompt=prompt,
            max_tokens=n,
            temperature=0.9,
            seed=11,
            extra_body={"return_token_ids": True},
        )
        return choice.model_extra["token_ids"]

    def constrained(seed):
        extra = {"response_format": JSON_SCHEMA, "logit_bias": {"34": 3}}
        return _completion(base_url, temperature=1.0, seed=seed, extra_body=extra)

    def any_object():  # a random model's object runs long: it overlaps the whole plain row
        extra = {"response_format": {"type": "json_object"}}
        return _completion(base_url, max_tokens=80, seed=1, extra_body=extra)

    assert CONFIG.slots >= 4
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(constrained, seed) for seed in (5, 6)]
        long = pool.submit(any_object)
        mine = pool.submit(plain)
        assert mine.result() == expected
        for other in others:
            jsonschema_rs.validate(SCHEMA, json.loads(other.result().text))
        assert long.result().text.startswith("{")


def test_the_scheduler_runs_constrained_rows_one_step_a_call_beside_multi_step_ones(loaded):
    """The scheduler alone, at 4 decode steps a call: a constrained row, a biased row and a
    plain row run together; the constrained one matches its schema, the plain one gives the
    tokens `generate_tokens` gives, the biased one never emits its banned token."""
    from lowbit.server import Job, Scheduler, SchedulerConfig
    from lowbit.server._grammar import Grammars

    config = SchedulerConfig(slots=3, max_len=64, single_pass=16, chunk=16, steps=4)
    scheduler = Scheduler(loaded.model, None, None, config)
    grammars = Grammars(loaded.tokenizer, [258], loaded.model.config.vocab_size)
    prompt = loaded.tokenizer.encode("Answer:").ids
    plain_tokens = generate_tokens(loaded.model, [prompt], max_new_tokens=30).tokens[0]
    banned = plain_tokens[0]
    answers, done = {}, {}

    def job(name, **kwargs):
        def emit(tokens, finish):
            answers.setdefault(name, []).extend(tokens)
            if finish is not None:
                done[name] = finish

        args = dict(max_tokens=30, temperature=0.0, top_k=0, top_p=1.0, seed=3)
        return Job(
            prompt,
            **(args | kwargs),
            stop_ids=frozenset([258]),
            deadline=time.monotonic() + 120,
            emit=emit,
        )

    scheduler.start()
    try:
        deadline = time.monotonic() + 300
        while not scheduler.ready:
            assert time.monotonic() < deadline and scheduler.error is None
            time.sleep(0.05)
        scheduler.submit(job("plain"))
        json_job = job(
            "json", max_tokens=48, temperature=1.0, constraint=grammars.constrain(SCHEMA)
        )
        scheduler.submit(json_job)
        scheduler.submit(job("biased", logit_bias=((banned, -100.0),)))
        while len(done) < 3:
            assert time.monotonic() < deadline and scheduler.error is None
            time.sleep(0.05)
    finally:
        scheduler.close()
    assert answers["plain"] == plain_tokens
    assert done["json"] == "stop"
    jsonschema_rs.validate(SCHEMA, json.loads(loaded.tokenizer.decode(answers["json"])))
    assert banned not in answers["biased"]
