"""``POST /v1/embeddings`` with the official `openai` client: vectors equal the mean-pooled,
normalized final hidden states computed outside the server, whatever the batch and padding;
bad input is a 400 naming the field; a completion running meanwhile is unaffected."""

import concurrent.futures
import functools
import re

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from compiled import compiled
from server_support import CONFIG, running

from lowbit.models import Sampling, generate_tokens
from lowbit.server._embeddings import MAX_INPUTS

# Vectors of the same text from batches of other shapes differ by float rounding only.
TOL = 1e-5


def _client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@functools.cache
def _hidden_states(model):
    return compiled(model, "hidden_states")


def _reference(loaded, ids):
    """The mean of the final norm's output over `ids`, normalized, without any padding."""
    hidden = _hidden_states(loaded.model)(jnp.asarray([ids], jnp.int32))[0]
    hidden = np.asarray(hidden, np.float64)
    pooled = hidden.mean(axis=0)
    return pooled / np.linalg.norm(pooled)


@pytest.mark.parametrize(
    "budget, widths",
    [
        (16, [16]),
        (32, [16, 32]),
        (100, [16, 64]),
        (256, [16, 64, 256]),
        (2048, [16, 64, 256, 1024, 2048]),
    ],
)
def test_batch_widths_step_by_four_up_to_the_budget(budget, widths):
    from lowbit.server._embeddings import batch_rows, embedding_widths

    assert embedding_widths(budget) == widths
    assert all(batch_rows(w, budget) * w <= budget for w in widths)


def test_without_embeddings_the_endpoint_is_a_400_and_undocumented(loaded, served):
    import dataclasses

    from starlette.testclient import TestClient

    from lowbit import server

    config = dataclasses.replace(CONFIG, embeddings=False)
    scheduler = server.Scheduler(loaded.model, None, None, config)  # not started: no compiling
    app = server.create_app(dataclasses.replace(served, scheduler=scheduler))
    with TestClient(app) as client:
        r = client.post("/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "embeddings_disabled"
        assert "--embeddings" in r.json()["error"]["message"]
        assert "/v1/embeddings" not in client.get("/openapi.json").json()["paths"]


def test_the_program_runs_the_quantized_weights_and_ignores_padding(loaded):
    """`embed` on int8 weights, in a padded batch of rows of several lengths, against the
    quantized model's hidden states of each input alone."""
    from flax import nnx

    from lowbit import serving
    from lowbit.engine import interpret
    from lowbit.server import _embeddings as embeddings

    graphdef, state = nnx.split(loaded.model)
    params, _ = serving.apply_recipe(loaded, state, "int8")
    inputs = [[5, 6, 7], list(range(1, 17))]
    tokens, lengths = embeddings.batch_arrays(inputs, [0, 1], 16, 3)
    embed = jax.jit(embeddings.embed, static_argnums=0)
    out = np.asarray(embed(graphdef, params, tokens, lengths))
    hidden = jax.jit(interpret(lambda p, t: nnx.merge(graphdef, p).hidden_states(t)))
    for row, ids in enumerate(inputs):
        alone = np.asarray(hidden(params, jnp.asarray([ids], jnp.int32))[0], np.float64)
        pooled = alone.mean(axis=0)
        np.testing.assert_allclose(out[row], pooled / np.linalg.norm(pooled), atol=TOL)
    np.testing.assert_array_equal(out[2], 0)  # the unused row
    float_out = np.asarray(embed(graphdef, state, tokens, lengths))
    assert np.abs(float_out - out).max() > 1e-4  # the weights really are int8


def test_one_text_is_its_mean_pooled_hidden_state(base_url, loaded):
    out = _client(base_url).embeddings.create(
        model="tiny", input="The quick brown fox", encoding_format="float"
    )
    assert out.object == "list" and out.model == "tiny" and len(out.data) == 1
    ids = loaded.tokenizer.encode("The quick brown fox").ids
    assert out.usage.prompt_tokens == out.usage.total_tokens == len(ids)
    vector = np.asarray(out.data[0].embedding)
    assert out.data[0].index == 0 and vector.shape == (loaded.model.config.dim,)
    assert abs(np.linalg.norm(vector) - 1) < 1e-5
    # The server pads the input to a batch of 16 tokens and more rows: nothing changes.
    np.testing.assert_allclose(vector, _reference(loaded, ids), atol=TOL)


def test_a_text_gets_the_same_vector_alone_or_in_a_batch(base_url, loaded):
    client = _client(base_url)
    texts = ["hello", "a longer one, past 16 bytes", "hello", "x y"]
    # No encoding_format: the client asks for base64 and decodes the float32 bytes itself.
    batch = client.embeddings.create(model="tiny", input=texts)
    assert [d.index for d in batch.data] == [0, 1, 2, 3]
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    vectors = np.asarray([d.embedding for d in batch.data])
    np.testing.assert_array_equal(vectors, np.asarray([d.embedding for d in floats.data]))
    for text, vector in zip(texts, vectors, strict=True):
        alone = client.embeddings.create(model="tiny", input=text, encoding_format="float")
        np.testing.assert_allclose(vector, alone.data[0].embedding, atol=TOL)
        ids = loaded.tokenizer.encode(text).ids
        np.testing.assert_allclose(vector, _reference(loaded, ids), atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert batch.usage.prompt_tokens == sum(len(loaded.tokenizer.encode(t).ids) for t in texts)


def test_token_ids_and_base64_as_sent(base_url, loaded):
    inputs = [[5, 6, 7], list(range(1, 30))]
    r = httpx.post(
        f"{base_url}/v1/embeddings",
        json={"model": "tiny", "input": inputs, "encoding_format": "base64", "dimensions": 64},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    import base64

    for item, ids in zip(body["data"], inputs, strict=True):
        assert item["object"] == "embedding"
        vector = np.frombuffer(base64.b64decode(item["embedding"]), "<f4")
        np.testing.assert_allclose(vector, _reference(loaded, ids), atol=TOL)
    one = httpx.post(f"{base_url}/v1/embeddings", json={"input": [5, 6, 7]}).json()
    np.testing.assert_allclose(one["data"][0]["embedding"], _reference(loaded, [5, 6, 7]), atol=TOL)
    assert one["usage"] == {"prompt_tokens": 3, "total_tokens": 3}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "tiny"}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["fine", ""]}, "input[1]"),
        ({"input": ["fine", [1, -2]]}, "input[1]"),
        ({"input": [[1, 2], []]}, "input[1]"),
        ({"input": ["text", [1, 2]]}, "input"),
        ({"input": [3] * (CONFIG.single_pass + 1)}, "input"),
        ({"input": [[3], [3] * (CONFIG.single_pass + 1)]}, "input[1]"),
        ({"input": ["a"] * (MAX_INPUTS + 1)}, "input"),
        ({"input": [9999]}, "input"),
        # A lone surrogate, escaped as JSON allows: not text the tokenizer encodes.
        (b'{"input": "a\\ud800b"}', "input"),
        ({"input": "hi", "dimensions": 3}, "dimensions"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "model": 5}, "model"),
        ({"input": "hi", "temperature": 0}, "temperature"),
    ],
)
def test_bad_input_gets_a_400_naming_the_field(base_url, body, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{base_url}/v1/embeddings", **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(param)


def test_the_client_sees_a_400_as_bad_request(base_url):
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        _client(base_url).embeddings.create(model="tiny", input="hi", dimensions=8)


def test_a_completion_running_meanwhile_is_unaffected(base_url, loaded, served):
    prompt = loaded.tokenizer.encode("Once upon a time").ids
    expected = generate_tokens(
        loaded.model,
        [prompt],
        max_new_tokens=60,
        sampling=Sampling(),
        key=0,
        stop_ids=sorted(served.stop_ids),
    ).tokens[0]
    client = _client(base_url)
    texts = ["x" * (5 + i % 25) for i in range(40)]  # widths 16 and 32
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        completion = pool.submit(
            client.completions.create,
            model="tiny",
            prompt=prompt,
            max_tokens=60,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        answers = list(
            pool.map(lambda t: client.embeddings.create(model="tiny", input=[t, "same"]), texts)
        )
        tokens = completion.result().choices[0].model_extra["token_ids"]
    assert tokens == expected
    same = np.asarray([a.data[1].embedding for a in answers])
    np.testing.assert_allclose(same, np.broadcast_to(same[0], same.shape), atol=TOL)
    metrics = httpx.get(f"{base_url}/metrics").text
    served_ok = re.search(
        r'lowbit_requests_total\{endpoint="/v1/embeddings",status="200"\} (\d+)', metrics
    )
    assert served_ok and int(float(served_ok.group(1))) >= len(texts)


def test_a_minilm_encoder_serves_embeddings_and_no_completions():
    models = pytest.importorskip("lowbit.models")
    if not models.has_minilm():
        pytest.skip("all-MiniLM-L6-v2 is not installed")
    from lowbit import server, serving

    loaded = serving.load_model("minilm")
    scheduler = server.Scheduler(loaded.model, None, None, CONFIG)
    assert not scheduler.generates
    served = server.ServedModel(
        name="minilm",
        tokenizer=loaded.tokenizer,
        chat_template=None,
        stop_ids=frozenset(),
        scheduler=scheduler,
    )
    texts = ["The cat sat on the mat.", "Stock markets fell.", "The cat sat on the mat."]
    with running(served) as url:
        out = _client(url).embeddings.create(model="minilm", input=texts)
        for path, body in [
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ]:
            r = httpx.post(f"{url}{path}", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            assert "encoder" in r.json()["error"]["message"]
    vectors = np.asarray([d.embedding for d in out.data])
    # sentence-transformers' pipeline, as `lowbit eval` runs it (a batch padded otherwise).
    expected = models.embed_sentences(loaded.model, loaded.tokenizer, texts)
    np.testing.assert_allclose(vectors, expected, atol=TOL)
    assert out.usage.prompt_tokens == sum(len(loaded.tokenizer.encode(t).ids) for t in texts)


def test_an_api_key_guards_embeddings(served, base_url):
    import dataclasses

    guarded = dataclasses.replace(served, api_key="s3cret")
    with running(guarded, start=False) as url:
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert len(client.embeddings.create(model="tiny", input="hi").data) == 1


def test_503_while_loading_and_a_full_queue_refuses_embeddings(loaded, served):
    import dataclasses

    from starlette.testclient import TestClient

    from lowbit import server
    from lowbit.server._embeddings import EmbedJob

    config = dataclasses.replace(CONFIG, queue=1)
    scheduler = server.Scheduler(loaded.model, None, None, config)  # never started
    app = server.create_app(dataclasses.replace(served, scheduler=scheduler))
    with TestClient(app) as client:
        r = client.post("/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
    scheduler.ready = True  # as after the warm-up, with no loop to take jobs
    job = lambda: EmbedJob(inputs=[[1]], deadline=float("inf"), done=lambda v, r: None)  # noqa: E731
    scheduler.submit_embedding(job())
    with pytest.raises(server.QueueFull):
        scheduler.submit_embedding(job())
    assert scheduler.queue_length == 1
