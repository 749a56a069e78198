"""scripts/serve.py's app against unkind clients: the real app (dsattn.serve.app) served by
uvicorn on a free local port in this process, over a real Runner and Scheduler of a tiny
model, driven over HTTP (httpx, raw sockets, the official `openai` client). Every refusal is
one line in OpenAI's error shape; a big or broken request never holds up the others; a client
that leaves frees its row; a dead scheduler answers at once. Expected texts come from the
model's own solo Engine.generate output."""

import concurrent.futures
import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from dsattn import generate, tokenizer
from dsattn.serve import prefix
from dsattn.serve.app import make_app
from dsattn.serve.runner import Runner
from dsattn.serve.scheduler import Scheduler
from tests.helpers import tiny_model

ROWS, MAX_LEN, CHUNK = 2, 128, 16
SMALL = ("model.n_layers=1", "model.d_model=32", "model.ffn_hidden=64", "attention.n_heads=2",
         "attention.n_kv_heads=2", "attention.head_dim=16")
NAME = "tiny-serve"  # the served model's name
C = "/v1/completions"


@pytest.fixture(scope="module")
def engine():
    eng = generate.Engine(tiny_model("mha", *SMALL))
    # every server below has these rows and sizes: their programs compile once, here
    Scheduler(eng, ROWS, MAX_LEN, max_chunk=CHUNK).warm_up()
    return eng


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(engine, step=None, tok=None, max_queue=None, sched=None, **app_kw):
    """A server's URL: uvicorn in a thread over a fresh Runner (of `sched`, default a fresh
    Scheduler). `step(original)` stands in for the scheduler's step (to slow, hold or break
    it); app_kw go to make_app."""
    sched = sched or Scheduler(engine, ROWS, MAX_LEN, max_chunk=CHUNK)
    if step is not None:
        original = sched.step
        sched.step = lambda: step(original)
    runner = Runner(sched, **({} if max_queue is None else {"max_queue": max_queue})).start()
    app = make_app(runner, tok or tokenizer.ByteTokenizer(), NAME, **app_kw)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        runner.close()


@pytest.fixture(scope="module")
def server(engine):
    with serving(engine) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="-", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def solo(engine):
    """(text, tokens) the model produces for a prompt alone: what the server must return."""
    tok = tokenizer.ByteTokenizer()

    def run(prompt, n, temperature=0.0, seed=0):
        ids = engine.generate([tok.encode(prompt)], n, temperature=temperature, seed=seed,
                              max_len=MAX_LEN, on_token=lambda row, t: None)[0]
        return tok.decode(ids), [int(t) for t in ids]

    return run


def post(url, body, timeout=60, **kw):
    """POST a JSON body (a dict) or raw bytes to /v1/completions."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + C, content=content, timeout=timeout,
                      headers={"content-type": "application/json", **kw.pop("headers", {})},
                      **kw)


def refused(r: httpx.Response, status: int, needle: str = "") -> dict:
    """The response is one refusal in OpenAI's error shape; its error."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert list(body) == ["error"], body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and "\n" not in err["message"], err
    assert needle in err["message"], err
    return err


# ---------------------------------------------------------------- 5. seeds
def test_unseeded_samples_differ_and_their_reported_seed_redraws_them(client, solo):
    kw = dict(model=NAME, prompt="ab", max_tokens=24, temperature=1.0)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text != b.choices[0].text
    for r in (a, b):  # each reports its seed, which redraws the sample
        assert isinstance(r.seed, int)
        assert r.choices[0].text == solo("ab", 24, 1.0, r.seed)[0]
    given = client.completions.create(**kw, seed=7)
    assert given.seed == 7 and given.choices[0].text == solo("ab", 24, 1.0, 7)[0]
    pieces = list(client.completions.create(**kw, seed=11, stream=True))
    assert {p.seed for p in pieces} == {11}
    assert "".join(p.choices[0].text for p in pieces) == solo("ab", 24, 1.0, 11)[0]


# ---------------------------------------------------------------- 6. big bodies
def test_a_body_past_the_limit_gets_413(engine, server):
    big = json.dumps({"prompt": "a" * (40 << 20), "max_tokens": 1}).encode()  # 40 MB
    refused(post(server, big), 413, "bytes")
    with serving(engine, max_body_bytes=1000) as url:
        refused(post(url, {"prompt": "a" * 2000, "max_tokens": 1}), 413, "1000 bytes")
        ok = post(url, {"prompt": "ab", "max_tokens": 1, "user": "u" * 900})  # 950 bytes
        assert ok.status_code == 200, ok.text
        # no length declared (chunked): counted as it arrives
        chunked = httpx.post(url + C, content=iter([b'{"prompt": "' + b"a" * 600] * 2),
                             timeout=30)
        assert "content-length" not in chunked.request.headers
        refused(chunked, 413, "1000 bytes")


class GatedBytes(tokenizer.ByteTokenizer):
    """Bytes; a prompt starting with HOLD waits in `encode` until `release` is set."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text):
        if text.startswith("HOLD"):
            self.entered.set()
            self.release.wait(120)
        return super().encode(text)


def test_a_request_being_parsed_and_tokenized_does_not_hold_up_a_small_one(engine):
    tok = GatedBytes()
    with serving(engine, tok=tok) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            # 3 MB of prompt, held in tokenizing (past the length check once it ends)
            big = pool.submit(post, url, {"prompt": "HOLD" + "a" * (3 << 20), "max_tokens": 1},
                              timeout=180)
            assert tok.entered.wait(60), "the big request never reached the tokenizer"
            small = post(url, {"prompt": "ab", "max_tokens": 2, "temperature": 0},
                         timeout=30)
            assert small.status_code == 200, small.text
            assert not big.done()  # answered while the big one was still in tokenizing
        finally:
            tok.release.set()
        refused(big.result(), 400, "max_tokens")


# ---------------------------------------------------------------- 7. clients that leave
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_its_completion_frees_its_row(engine, stream):
    slow = lambda step: (time.sleep(0.02), step())[1]  # noqa: E731  (>= 2 s for 120 tokens)
    with serving(engine, step=slow) as url:
        metrics = lambda: httpx.get(url + "/metrics", timeout=10).json()  # noqa: E731
        before = metrics()["generated_tokens"]
        n = MAX_LEN - 8
        body = json.dumps({"prompt": "abcdefgh", "max_tokens": n, "temperature": 0,
                           "stream": stream}).encode()
        sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while metrics()["active_rows"] == 0:
            assert time.monotonic() < deadline, "the request never started"
        sock.close()  # the client leaves: no stream, no answer read
        while (m := metrics())["active_rows"] or m["queued"]:
            assert time.monotonic() < deadline + 60, "its row was never freed"
            time.sleep(0.05)
        assert m["generated_tokens"] - before < n // 2, (m, before)
        assert m["open_requests"] == 0


# ---------------------------------------------------------------- 8. a dead scheduler
@pytest.mark.parametrize("stream", [False, True])
def test_a_dead_scheduler_answers_503_at_once_and_health_says_why_in_one_line(engine, stream):
    def broken(step):
        raise RuntimeError("the device fell over")

    with serving(engine, step=broken) as url:
        # the request in flight when it dies: a 503, or an error event ending its stream
        r = post(url, {"prompt": "ab", "max_tokens": 4, "stream": stream}, timeout=30)
        if stream:
            assert r.status_code == 200
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert "[DONE]" not in events
            err = json.loads(events[-1])["error"]
            assert err["type"] == "server_error" and "the device fell over" in err["message"]
        else:
            refused(r, 503, "the device fell over")
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503
        why = health.json()
        assert why["status"] == "down" and "RuntimeError: the device fell over" in why["error"]
        assert "\n" not in why["error"] and "File " not in why["error"], why
        assert ".py" not in why["error"] and "/" not in why["error"], why
        t0 = time.monotonic()
        for stream in (False, True):  # new requests: at once, whatever they ask
            refused(post(url, {"prompt": "ab", "max_tokens": 4, "stream": stream},
                         timeout=10), 503, "the device fell over")
        assert time.monotonic() - t0 < 5


# ---------------------------------------------------------------- 9. API mismatches
def test_a_lone_surrogate_in_the_prompt_is_a_400(server):
    err = refused(post(server, b'{"prompt": "ab\\ud800cd", "max_tokens": 2}'), 400, "prompt")
    assert "surrogate" in err["message"]
    refused(post(server, b'{"prompt": "ab", "stop": ["\\udfff"]}'), 400, "stop")


@pytest.mark.parametrize("raw, needle", [
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "UTF-8"),
    (b"", "JSON"),
    (b"{bad", "JSON"),
    (b'{"prompt": "ab", "temperature": NaN}', "NaN"),
    (b'{"prompt": "ab", "temperature": Infinity}', "Infinity"),
    (b"[" * 100_000 + b"]" * 100_000, "JSON"),
    (b'{"prompt": "ab", "max_tokens": ' + b"9" * 5000 + b"}", "JSON"),
    (b'["ab"]', "a JSON object"),
])
def test_a_body_that_is_not_a_json_object_is_a_400_in_openais_shape(server, raw, needle):
    refused(post(server, raw), 400, needle)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", True), ("max_tokens", "3"), ("max_tokens", 3.0), ("seed", True),
    ("temperature", True), ("top_p", False), ("stream", "yes"), ("stream", 1),
    ("prompt", 5), ("stop", 7), ("stop", ["a", 7]), ("model", 3),
])
def test_a_value_of_the_wrong_type_is_refused_not_converted(server, field, value):
    err = refused(post(server, {"prompt": "ab", "max_tokens": 2, field: value}), 400, field)
    assert err["param"] == field


def test_an_unknown_model_is_a_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="ab", max_tokens=2)
    assert e.value.code == "model_not_found" and "gpt-4" in e.value.message


def test_models_lists_the_served_model(client, server):
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_tokens_count_the_text_returned_not_the_tokens_drawn(client, solo):
    # a sampled output (greedy repeats one byte) with a stop string well inside it, two
    # characters that begin on a token of their own and first appear there
    for seed in range(20):
        full, ids = solo("ab", 40, 1.0, seed)
        cut = next((k for k in range(6, 30) if solo_prefix_ok(full, ids, k)), None)
        if cut is not None:
            break
    stop = full[len(_text(ids[:cut])):][:2]
    r = client.completions.create(model=NAME, prompt="ab", max_tokens=40, temperature=1.0,
                                  seed=seed, stop=[stop])
    text = r.choices[0].text
    assert full.startswith(text) and r.choices[0].finish_reason == "stop"
    # the fewest of the solo tokens whose text holds the returned text
    want = next(k for k in range(len(ids) + 1) if _text(ids[:k]).startswith(text))
    assert r.usage.completion_tokens == want < len(ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + want


def _text(ids):
    return tokenizer.ByteTokenizer().decode(ids)


def solo_prefix_ok(full, ids, k) -> bool:
    """Whether the first k tokens decode to whole characters of `full`, and the 2 characters
    after them first appear there."""
    head = _text(ids[:k])
    nxt = full[len(head):][:2]
    return full.startswith(head) and len(nxt) == 2 and full.find(nxt) == len(head)


def test_an_unserved_endpoint_is_a_404_naming_the_served_ones(client, server):
    err = refused(httpx.post(server + "/v1/chat/completions", timeout=10,
                             json={"model": NAME, "messages": [{"role": "user",
                                                                "content": "hi"}]}), 404)
    assert "/v1/chat/completions" in err["message"] and "POST /v1/completions" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
    refused(httpx.get(server + C, timeout=10), 405, "POST /v1/completions")


def test_the_length_error_names_max_tokens(server):
    err = refused(post(server, {"prompt": "a" * (MAX_LEN - 2), "max_tokens": 4}), 400,
                  "max_tokens")
    assert "max_new_tokens" not in err["message"] and str(MAX_LEN) in err["message"]


# ---------------------------------------------------------------- other bad requests
@pytest.mark.parametrize("body, needle", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "ab", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "ab", "max_tokens": 10 ** 30}, "max_tokens"),
    ({"prompt": "ab", "temperature": -1}, "temperature"),
    ({"prompt": "ab", "temperature": 1e308}, "temperature"),  # OpenAI's range: [0, 2]
    ({"prompt": "ab", "top_p": 1.5}, "top_p"),
    ({"prompt": "ab", "seed": -1}, "seed"),
    ({"prompt": "ab", "seed": 2 ** 40}, "seed"),
    ({"prompt": "ab", "stop": ["a"] * 5}, "stop"),  # OpenAI's limit: 4
    ({"prompt": "ab", "n": 0}, "n"),
    ({"prompt": "ab", "n": ROWS + 1}, f"n: at most {ROWS}"),
    ({"prompt": "ab", "best_of": 3}, "best_of"),
    ({"prompt": "ab", "logprobs": 2}, "logprobs"),
    ({"prompt": "ab", "echo": True}, "echo"),
    ({"prompt": "ab", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "ab", "logit_bias": {"1": 5}}, "logit_bias"),
    ({"prompt": "ab", "suffix": "x"}, "suffix"),
    ({"prompt": ["ab", "cd"]}, "prompt"),
    ({"prompt": "ab", "frobnicate": 1}, "unknown field 'frobnicate'"),
])
def test_other_bad_requests_are_one_400_naming_the_field(server, body, needle):
    refused(post(server, body), 400, needle)


def test_openais_no_op_values_and_nulls_are_accepted(client, server, solo):
    r = client.completions.create(model=NAME, prompt="ab", max_tokens=6, temperature=0, n=1,
                                  best_of=1, logprobs=None, echo=False, presence_penalty=0,
                                  frequency_penalty=0, logit_bias={}, user="someone",
                                  suffix=None)
    assert r.choices[0].text == solo("ab", 6)[0]
    # null stands for the default (OpenAI's fields are nullable): 16 tokens, greedy at 0
    raw = post(server, {"prompt": "ab", "max_tokens": None, "top_p": None, "stop": None,
                        "temperature": 0, "seed": None, "stream": None})
    assert raw.status_code == 200, raw.text
    assert raw.json()["usage"]["completion_tokens"] == 16


def test_n_choices_are_the_requests_of_seeds_seed_plus_i(client, solo):
    kw = dict(model=NAME, prompt="ab", max_tokens=12, temperature=1.0, seed=5, n=ROWS)
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == list(range(ROWS))
    want = [solo("ab", 12, 1.0, 5 + i) for i in range(ROWS)]
    assert [c.text for c in r.choices] == [text for text, _ in want]
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 12 * ROWS
    streamed = ["" for _ in range(ROWS)]
    for piece in client.completions.create(**kw, stream=True):
        for c in piece.choices:
            streamed[c.index] += c.text
    assert streamed == [text for text, _ in want]


def test_n_choices_are_admitted_all_or_none(engine):
    gate = threading.Event()
    held = lambda step: (gate.wait(120), step())[1]  # noqa: E731
    with serving(engine, step=held, max_queue=1) as url, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            body = {"prompt": "ab", "max_tokens": 3, "temperature": 0}
            first = pool.submit(post, url, {**body, "n": ROWS}, timeout=180)
            deadline = time.monotonic() + 60
            while httpx.get(url + "/metrics", timeout=10).json()["open_requests"] < ROWS:
                assert time.monotonic() < deadline, "the request never arrived"
                time.sleep(0.05)
            refused(post(url, {**body, "n": ROWS}, timeout=30), 429)  # 1 place left, not 2
            assert httpx.get(url + "/metrics", timeout=10).json()["open_requests"] == ROWS
        finally:
            gate.set()
        assert len(first.result().json()["choices"]) == ROWS


# ---------------------------------------------------------------- 10. access and back-pressure
def test_the_api_key_guards_every_route_but_health(engine):
    with serving(engine, api_key="sekrit") as url:
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        for method, path in [("GET", "/metrics"), ("GET", "/v1/models"), ("POST", C),
                             ("POST", "/v1/chat/completions")]:
            for headers in ({}, {"authorization": "Bearer wrong"}):
                err = refused(httpx.request(method, url + path, headers=headers, timeout=10,
                                            json={"prompt": "ab", "max_tokens": 1}), 401)
                assert err["code"] == "invalid_api_key" and "sekrit" not in err["message"]
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit", max_retries=0, timeout=60)
        assert good.completions.create(model=NAME, prompt="ab", max_tokens=2).choices
        assert [m.id for m in good.models.list()] == [NAME]
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=NAME, prompt="ab", max_tokens=2)


def test_a_full_queue_answers_429_with_retry_after(engine):
    gate = threading.Event()
    held = lambda step: (gate.wait(120), step())[1]  # noqa: E731
    with serving(engine, step=held, max_queue=1) as url, \
            concurrent.futures.ThreadPoolExecutor(ROWS + 1) as pool:
        try:
            body = {"prompt": "ab", "max_tokens": 3, "temperature": 0}
            taken = [pool.submit(post, url, body, timeout=180) for _ in range(ROWS + 1)]
            deadline = time.monotonic() + 60
            while httpx.get(url + "/metrics", timeout=10).json()["open_requests"] < ROWS + 1:
                assert time.monotonic() < deadline, "the requests never arrived"
                time.sleep(0.05)
            r = post(url, body, timeout=30)  # rows + max_queue are taken
            err = refused(r, 429)
            assert err["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
        finally:
            gate.set()
        assert [t.result().status_code for t in taken] == [200] * (ROWS + 1)
        assert post(url, body, timeout=60).status_code == 200  # room again


# ---------------------------------------------------------------- prefix caching
def reused(published: list, prompt: list, stride: int, block: int) -> int:
    """Prompt tokens `prompt` can restore after requests of the `published` prompts ran one
    after the other. A request's points are every multiple of `stride` up to its length - 1
    and its last block boundary; it publishes those an earlier request's points had too
    (a prefix seen once is not kept); `prompt` takes the deepest published one it shares
    that ends by len(prompt) - 1 (one prompt token is always prefilled, for the first
    draw)."""
    points = lambda p: {*range(stride, len(p), stride), (len(p) - 1) // block * block} - {0}  # noqa: E731,E501
    kept = [(e, p) for j, p in enumerate(published) for e in points(p)
            if any(e in points(q) and q[:e] == p[:e] for q in published[:j])]
    return max((e for e, p in kept if e <= len(prompt) - 1 and p[:e] == prompt[:e]),
               default=0)


@pytest.mark.parametrize("cache", [True, False])
def test_cached_tokens_count_the_prompt_reused_and_metrics_sum_them(engine, solo, cache):
    # prefixes published at twice the default stride: a last block boundary between them
    sched = Scheduler(engine, ROWS, MAX_LEN, max_chunk=CHUNK, prefix_cache=cache,
                      prefix_stride=2 * prefix.stride(engine.cfg, CHUNK))
    stride, block = 2 * prefix.stride(engine.cfg, CHUNK), prefix.block_size(engine.cfg)
    if cache:
        assert (sched.stride, sched.block) == (stride, block)
    tok = tokenizer.ByteTokenizer()
    shared = ("the quick brown fox jumps over the lazy dog; " * 8)[:stride + block + 3]
    first, second = shared + "alpha", shared + "omega!"
    asks = [(first, 0.0, 0), (second, 1.0, 3), (first, 1.0, 4)]  # (prompt, temperature, seed)
    with serving(engine, sched=sched) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120)
        done, hits = [], 0
        for prompt, temperature, seed in asks:  # one after the other
            r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6,
                                          temperature=temperature, seed=seed)
            assert r.choices[0].text == solo(prompt, 6, temperature, seed)[0]
            ids = tok.encode(prompt)
            want = reused(done, ids, stride, block) if cache else 0
            assert r.usage.prompt_tokens == len(ids)
            assert r.usage.prompt_tokens_details.cached_tokens == want, (prompt, want)
            done.append(ids)
            hits += want
        # the third reuses the last block boundary the second published (the first had that
        # prefix too), past its last stride multiple
        assert reused(done[:2], done[2], stride, block) == len(shared) // block * block
        assert len(shared) // block * block % stride != 0
        metrics = lambda: httpx.get(url + "/metrics", timeout=10).json()  # noqa: E731
        deadline = time.monotonic() + 10  # refreshed once the last step's events are out
        while (m := metrics())["prefix_hit_tokens"] != hits and time.monotonic() < deadline:
            time.sleep(0.02)
        assert m["prefix_cache"] is cache and m["prefix_hit_tokens"] == hits, m
        assert m["prefix_prompt_tokens"] == (sum(map(len, done)) if cache else 0), m
        assert (m["prefix_nodes"] > 0) is cache and set(m["prefix_refused"]) == {
            "replay_window"}, m
        for key in ("prefix_cached_pages", "prefix_snapshot_bytes", "prefix_evictions",
                    "prefix_copies"):
            assert isinstance(m[key], int) and m[key] >= 0, (key, m)
        # n choices: the prompt, and its cached tokens, are counted once (choice 0's: it
        # found nothing cached); choice 1 reuses the prefix choice 0 computes beside it
        third = ("pack my box with five dozen liquor jugs. " * 8)[:stride + 1]
        r = client.completions.create(model=NAME, prompt=third, max_tokens=4,
                                      temperature=1.0, seed=9, n=2)
        assert [c.text for c in r.choices] == [solo(third, 4, 1.0, 9 + i)[0] for i in range(2)]
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        # the choices are two requests of one prompt: choice 0 publishes what choice 1 takes
        sibling = reused([tok.encode(third)] * 2, tok.encode(third), stride, block) if cache else 0
        deadline = time.monotonic() + 10
        while metrics()["prefix_hit_tokens"] != hits + sibling and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metrics()["prefix_hit_tokens"] == hits + sibling
