"""`logprobs` (completions) and `logprobs`/`top_logprobs` (chat) through the official client:
the values are log-softmax of the model's own logits, computed here without the server."""

import numpy as np
import openai
from reference_logits import answer_logits, log_softmax
from server_support import CONFIG

PROMPT = "The quick brown fox"
TOLERANCE = 2e-3  # the server's KV-cache decode against one full forward pass, in float32


def _client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)


def _check_against_the_model(loaded, prompt_ids, ids, chosen, tops):
    """`chosen[i]` is token `ids[i]`'s log-probability and `tops[i]` the (id, logprob) pairs
    of the largest ones, per the model's logits after ``prompt + ids[:i]``."""
    assert len(chosen) == len(ids) >= 2
    references = log_softmax(answer_logits(loaded, prompt_ids, ids))
    for i, (token, reference) in enumerate(zip(ids, references, strict=True)):
        assert abs(chosen[i] - reference[token]) < TOLERANCE, i
        values = [lp for _, lp in tops[i]]
        assert values == sorted(values, reverse=True)
        expected = np.sort(reference)[::-1][: len(values)]
        np.testing.assert_allclose(values, expected, atol=TOLERANCE)
        assert tops[i][0][1] == chosen[i]  # greedy: the chosen token is the most likely one


def test_completion_logprobs_are_the_models_own(base_url, loaded):
    out = _client(base_url).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    texts = [loaded.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    for token, text in zip(lp.tokens, texts, strict=True):
        # Part of a character: OpenAI's "bytes:\xNN" form.
        assert token == text or (token.startswith("bytes:\\x") and "\ufffd" in text)
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert all(len(top) == 3 for top in lp.top_logprobs)
    prompt_ids = loaded.tokenizer.encode(PROMPT).ids
    references = log_softmax(answer_logits(loaded, prompt_ids, ids))
    for i, (token, reference) in enumerate(zip(ids, references, strict=True)):
        assert abs(lp.token_logprobs[i] - reference[token]) < TOLERANCE
        assert max(lp.top_logprobs[i].values()) == lp.token_logprobs[i]  # greedy


def test_chat_logprobs_and_top_logprobs(base_url, loaded):
    messages = [{"role": "user", "content": "hello"}]
    out = _client(base_url).chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    content = choice.logprobs.content
    tokenizer = loaded.tokenizer
    assert all(len(item.top_logprobs) == 5 for item in content)
    prompt_ids = tokenizer.encode("user: hello\nassistant:").ids
    chosen = [item.logprob for item in content]
    tops = [[(alt.bytes, alt.logprob) for alt in item.top_logprobs] for item in content]
    _check_against_the_model(loaded, prompt_ids, ids, chosen, tops)
    # Each token's bytes are what it stands for: together, the answer's bytes.
    raw = b"".join(bytes(item.bytes) for item in content)
    assert raw.decode("utf-8", errors="replace") == tokenizer.decode(ids)


def test_logprobs_zero_reports_the_chosen_token_only(base_url):
    out = _client(base_url).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0.7,
        seed=3,
        logprobs=True,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(item.top_logprobs == [] and item.logprob <= 0 for item in content)


def test_streamed_logprobs_equal_the_whole_answers(base_url):
    client = _client(base_url)
    args = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.9, seed=11, logprobs=2)
    whole = client.completions.create(**args).choices[0].logprobs
    tokens, values, offsets = [], [], []
    for chunk in client.completions.create(**args, stream=True):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            values += lp.token_logprobs
            offsets += lp.text_offset
    assert (tokens, values, offsets) == (whole.tokens, whole.token_logprobs, whole.text_offset)

    chat = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    whole = client.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(**chat, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [item.model_dump() for item in streamed] == [item.model_dump() for item in whole]


def test_requests_without_logprobs_answer_none(base_url):
    out = _client(base_url).completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert out.choices[0].logprobs is None


def test_a_chunked_prompts_first_token_has_its_logprobs(base_url, loaded):
    # Longer than CONFIG.single_pass: prefilled in chunks, its first token sampled apart.
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 250, CONFIG.single_pass + 9)]
    out = _client(base_url).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    references = log_softmax(answer_logits(loaded, prompt, ids))
    chosen = choice.logprobs.token_logprobs
    assert len(chosen) == len(ids) >= 1
    for value, token, reference in zip(chosen, ids, references, strict=True):
        assert abs(value - reference[token]) < TOLERANCE
