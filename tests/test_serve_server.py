"""scripts/serve.py as a client meets it: the real server on a free local port, driven by
the official `openai` client. Each completion equals the run's own solo Engine.generate
output through the tokenizer, streamed or not, alone or among 8 concurrent requests; bad
requests get one 400 message and leave the others' outputs unchanged."""

import concurrent.futures
import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from dsattn import cli, generate, tokenizer
from tests.test_scripts import ROOT, TINY, script

ROWS, MAX_LEN = 3, 64


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("serve") / "tiny"
    p = script("train", "configs/tiny/mha.yaml", "--run-dir", run, "--quiet", *TINY)
    assert p.returncode == 0, p.stderr.decode()
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(run_dir, *flags, env=None):
    """scripts/serve.py on a free port, once /health answers; its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "serve.py"), str(run_dir),
                             "--port", str(port), "--rows", str(ROWS), "--max-len",
                             str(MAX_LEN), "--max-chunk", "16", *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(run_dir):
    with serve(run_dir) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="-", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def solo(run_dir):
    """Text the run's model produces for a prompt alone (Engine.generate, the run's
    tokenizer): what the server must return."""
    model, _, _ = cli.load_run(run_dir)
    eng, tok = generate.Engine(model), tokenizer.for_run(run_dir)

    def text(prompt, n, temperature=0.0, seed=0):
        ids = eng.generate([tok.encode(prompt)], n, temperature=temperature, seed=seed,
                           max_len=MAX_LEN, on_token=lambda row, t: None)[0]
        return tok.decode(ids)

    return text


PROMPTS = ["def ", "import os\n", "class A:", "x = 1", "for i in", "# a", "return", "if x:"]


def test_completion_equals_solo_generate(client, solo):
    r = client.completions.create(model="tiny", prompt="def ", max_tokens=12, temperature=0)
    assert r.choices[0].text == solo("def ", 12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 4


def test_streamed_pieces_join_to_the_completion(client, solo):
    pieces = list(client.completions.create(model="tiny", prompt="x = 1", max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == solo("x = 1", 10)
    assert len(pieces) > 1 and pieces[-1].choices[0].finish_reason == "length"


def test_a_stop_string_ends_the_completion_before_it(client, solo):
    full = solo("class A:", 16)
    stop = full[5:7]
    r = client.completions.create(model="tiny", prompt="class A:", max_tokens=16,
                                  temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_eight_concurrent_requests_each_equal_their_solo_output(client, solo):
    def ask(i):
        kw = dict(temperature=0.9, seed=i) if i % 2 else dict(temperature=0)
        r = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=6 + i, **kw)
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    want = [solo(PROMPTS[i], 6 + i, 0.9 if i % 2 else 0.0, i) for i in range(8)]
    assert got == want


@pytest.mark.parametrize("kwargs, needle", [
    (dict(prompt="a" * MAX_LEN, max_tokens=4), f"exceeds this model's {MAX_LEN} tokens"),
    (dict(prompt="a", max_tokens=-1), "max_tokens"),
    (dict(prompt="a", max_tokens=2, extra_body={"frob": 3}), "unknown field 'frob'"),
    (dict(prompt="a", max_tokens=2, extra_body={"best_of": 3}), "best_of"),
    (dict(prompt="a", max_tokens=2, top_p=0), "top_p"),
])
def test_bad_requests_get_one_400_and_leave_the_others_alone(client, solo, kwargs, needle):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(lambda: "".join(
            p.choices[0].text for p in client.completions.create(
                model="tiny", prompt="import os\n", max_tokens=20, temperature=0,
                stream=True)))
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", **kwargs)
        assert e.value.status_code == 400 and needle in e.value.message, e.value.message
        assert good.result() == solo("import os\n", 20)


def test_health_and_metrics(server, client):
    client.completions.create(model="tiny", prompt="# a", max_tokens=3, temperature=0)
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    m = httpx.get(f"{server}/metrics").json()
    assert m["rows"] == ROWS and m["queued"] == 0 and m["active_rows"] == 0
    assert m["pages_free"] == m["pages_total"] == 0  # MHA: a contiguous cache, no pools
    assert m["generated_tokens"] > 0 and m["tokens_per_s"] >= 0
    assert m["prefix_cache"] is True and m["prefix_prompt_tokens"] > 0  # on by default


def test_the_api_key_queue_body_limit_and_prefix_cache_flags(run_dir, monkeypatch):
    env = dict(os.environ, DSATTN_API_KEY="sekrit")  # the key from the environment
    with serve(run_dir, "--no-warm-up", "--max-queue", "5", "--max-body-bytes", "2000",
               "--no-prefix-cache", env=env) as url:
        assert httpx.get(f"{url}/health").status_code == 200  # no key needed
        assert httpx.get(f"{url}/v1/models").status_code == 401
        key = {"authorization": "Bearer sekrit"}
        models = httpx.get(f"{url}/v1/models", headers=key).json()
        assert [m["id"] for m in models["data"]] == [run_dir.name]
        m = httpx.get(f"{url}/metrics", headers=key).json()
        assert m["max_queue"] == 5 and m["prefix_cache"] is False
        big = httpx.post(f"{url}/v1/completions", headers=key,
                         json={"prompt": "a", "user": "u" * 2000})
        assert big.status_code == 413 and "2000 bytes" in big.json()["error"]["message"]
    from scripts import serve as serve_script

    monkeypatch.delenv("DSATTN_API_KEY", raising=False)
    parse = lambda *a: cli.parse(serve_script.parser(), ["run", *a])  # noqa: E731
    assert parse().api_key is None and parse("--api-key", "k").api_key == "k"
    assert parse().max_queue == 64 and parse().max_body_bytes is None
    assert parse().prefix_cache is True and parse("--no-prefix-cache").prefix_cache is False
    assert parse().prefix_cache_nodes is None and parse().prefix_stride is None
    flags = parse("--prefix-cache-nodes", "12", "--prefix-stride", "32")
    assert (flags.prefix_cache_nodes, flags.prefix_stride) == (12, 32)
    monkeypatch.setenv("DSATTN_API_KEY", "from-env")
    assert parse().api_key == "from-env" and parse("--api-key", "k").api_key == "k"
