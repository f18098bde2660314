"""The OpenAI-compatible server on the demo and tiny models: real HTTP on a free localhost port,
through the `openai` client and raw httpx."""
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from sparseserve import LLM, SamplingParams
from sparseserve.chat import encode_messages, parse_output
from sparseserve.model.loader import CONFIGS_DIR

from server_utils import free_port, running_server, write_v4_tokenizer

TINY = str(CONFIGS_DIR / "tiny")
PROMPTS = ["Beautiful is better", "Flat is", "Errors should never", "Now is better than never"]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=64)


def offline(model, prompts, **kw):
    llm = LLM(model, **ENGINE)
    return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


@pytest.fixture(scope="module")
def tiny():
    with running_server(LLM(TINY, **ENGINE).llm_engine, names=("tiny", "alias")) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(tiny):
    return openai.OpenAI(base_url=tiny[0] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("model", [None, TINY], ids=["demo", "tiny"])
def test_greedy_completions_equal_llm_generate(model):
    expected = offline(model, PROMPTS, temperature=0, max_tokens=8)
    with running_server(LLM(model, **ENGINE).llm_engine, names=("m",)) as (url, _):
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        got = c.completions.create(model="m", prompt=PROMPTS, max_tokens=8, temperature=0)
        assert [ch.text for ch in sorted(got.choices, key=lambda ch: ch.index)] == [e.outputs[0].text for e in expected]
        assert got.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)
        assert got.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)


def test_streamed_text_equals_non_streamed_and_usage(client):
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == plain.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_n_seed_token_prompts_and_choice_order(client):
    ids = [[5, 9, 33, 70], [100, 4, 8]]
    a = client.completions.create(model="alias", prompt=ids, n=3, max_tokens=5, temperature=1.0, seed=7)
    assert sorted(ch.index for ch in a.choices) == list(range(6))
    assert a.usage.prompt_tokens == 7 and a.usage.completion_tokens == 30
    b = list(client.completions.create(model="tiny", prompt=ids, n=3, max_tokens=5, temperature=1.0, seed=7,
                                       stream=True))
    streamed = {}
    for ch in b:
        for choice in ch.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {ch.index: ch.text for ch in a.choices}  # seeded sampling is batch-independent
    assert len({ch.text for ch in a.choices[:3]}) > 1


def test_stops_and_logprobs(client):
    base = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=2)
    text, lp = base.choices[0].text, base.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 12 == base.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    ref = offline(TINY, [PROMPTS[1]], temperature=0, max_tokens=12, logprobs=2)[0].outputs[0]
    assert lp.token_logprobs == pytest.approx([ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)],
                                              abs=1e-4)
    stop = text[3:6]
    cut = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop], stream=True) if ch.choices)
    assert streamed == cut.choices[0].text
    tid = ref.token_ids[2]
    by_id = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                      extra_body={"stop_token_ids": [tid]})
    assert by_id.choices[0].finish_reason == "stop" and by_id.usage.completion_tokens == ref.token_ids.index(tid) + 1


def test_info_endpoints(tiny, client):
    url, _ = tiny
    assert [m.id for m in client.models.list().data] == ["tiny", "alias"]
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/version").json()["version"]
    tok = httpx.post(url + "/tokenize", json={"prompt": "Flat is"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 128
    assert httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith("Flat is")
    client.completions.create(model="tiny", prompt="Flat", max_tokens=3)
    metrics = httpx.get(url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total",
                 "spec_decode_num_accepted_tokens_total"):
        assert f"sparseserve:{name}" in metrics
    gen = [line for line in metrics.splitlines() if line.startswith("sparseserve:generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 3


def test_api_key():
    with running_server(LLM(TINY, **ENGINE).llm_engine, api_key="sekrit") as (url, _):
        assert httpx.get(url + "/v1/models").status_code == 401
        bad = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and "API key" in bad.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="Flat", max_tokens=2).usage.completion_tokens == 2


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 7}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 3}, "min_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 100000}, "n"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, "gpt-4"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "vocabulary"),
    ("/v1/completions", {"prompt": [5] * 200}, "max_model_len"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 3}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "chat format"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "exactly one"),
    ("/detokenize", {"tokens": [-1]}, "vocabulary"),
]


def test_bad_requests_get_4xx_with_clear_messages_and_the_server_goes_on(tiny):
    url, engine = tiny
    with httpx.Client(base_url=url, timeout=60) as http:
        for path, body, needle in BAD_REQUESTS:
            r = http.post(path, json=body)
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert needle.lower() in err["message"].lower() + str(err["param"]).lower(), (body, err)
            assert set(err) == {"message", "type", "param", "code"}
        for raw in (b"{not json", b"[1, 2]"):
            r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["message"]
        good = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 6
    assert engine.engine.all_cache_free()


def test_full_queue_answers_503_at_once(tiny):
    url, engine = tiny
    engine.max_waiting_requests = 0
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "max_waiting_requests" in r.json()["error"]["message"]
    finally:
        engine.max_waiting_requests = None


def test_disconnect_aborts_and_frees_the_cache(tiny):
    url, engine = tiny
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 100, "stream": True,
                                                          "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    deadline = time.monotonic() + 20
    while not engine.engine.all_cache_free() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.engine.all_cache_free() and not engine.engine.has_unfinished_requests()


def test_chat_in_deepseek_v4_format(tmp_path):
    tok_dir = write_v4_tokenizer(tmp_path / "v4tok")
    llm = LLM(TINY, tokenizer=str(tok_dir), **ENGINE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = encode_messages(messages, thinking=True)
    ids = llm.get_tokenizer().encode(prompt, add_special_tokens=False)
    with running_server(llm.llm_engine) as (url, engine):
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0,
                  extra_body={"chat_template_kwargs": {"thinking": True}})
        plain = c.chat.completions.create(**kw)
        assert plain.usage.prompt_tokens == len(ids)
        message = plain.choices[0].message
        reasoning = message.model_extra.get("reasoning_content")
        chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        s_reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or ""
                              for ch in chunks if ch.choices)
        s_content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert (s_reasoning, s_content) == (reasoning or "", message.content or "")
        assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
        tok = httpx.post(url + "/tokenize", json={"messages": messages,
                                                  "chat_template_kwargs": {"thinking": True}}).json()
        assert tok["tokens"] == ids


def test_load_64_streaming_clients_with_cancellations(tiny):
    """A few hundred streamed requests from 64 concurrent clients, every seventh cancelled mid-stream:
    no errors, greedy tokens equal the offline result, no KV block or slot left held."""
    import asyncio

    url, engine = tiny
    prompts = [f"{PROMPTS[i % 4]} {'x' * (i % 5)}" for i in range(20)]
    ref = {p: o.outputs[0].text for p, o in zip(prompts, offline(TINY, prompts, temperature=0, max_tokens=4))}
    total, concurrency = 192, 64

    async def one(http, i):
        p = prompts[i % len(prompts)]
        body = {"prompt": p, "max_tokens": 4, "temperature": 0, "stream": True}
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += "".join(ch["text"] for ch in chunk["choices"])
                if i % 7 == 3:
                    return "cancelled"
        assert text == ref[p], (p, text, ref[p])
        return "done"

    async def main():
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=120,
                                     limits=httpx.Limits(max_connections=concurrency)) as http:
            async def guarded(i):
                async with sem:
                    return await one(http, i)
            return await asyncio.gather(*(guarded(i) for i in range(total)))

    results = asyncio.run(main())
    assert results.count("cancelled") == len([i for i in range(total) if i % 7 == 3])
    assert results.count("done") + results.count("cancelled") == total
    deadline = time.monotonic() + 30
    while not engine.engine.all_cache_free() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.engine.all_cache_free() and not engine.engine.groups and engine.is_running


def test_bench_serve_against_the_server(tiny, tmp_path):
    from sparseserve.benchmarks import serve
    from sparseserve.entrypoints.cli import build_parser

    out = tmp_path / "serve.json"
    args = build_parser().parse_args(["bench", "serve", "--base-url", tiny[0], "--num-prompts", "6", "--input-len",
                                      "8", "--output-len", "4", "--max-concurrency", "3", "--range-ratio", "0.5",
                                      "--vocab-size", "500", "--save-result", "--result-file", str(out)])
    summary = serve.run(args)
    saved = json.loads(out.read_text())
    assert saved["completed"] == summary["completed"] == 6 and saved["failed"] == 0
    assert saved["total_output_tokens"] > 0 and saved["ttft_ms"]["p99"] > 0 and "p50" in saved["itl_ms"]


def test_sparseserve_serve_command_starts_and_stops():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sparseserve.entrypoints.cli", "serve", "tiny", "--port", str(port),
                             "--device", "cpu", "--max-model-len", "64", "--max-num-seqs", "4",
                             "--uvicorn-log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Flat is", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "tiny"
    finally:
        proc.terminate()
        proc.wait(30)


class _ScriptedEngine:
    """Stands in for AsyncLLMEngine and answers every request with one fixed output, cut into the
    given pieces (DELTA) or whole (FINAL_ONLY): the HTTP and parsing path of a tool-calling V4 model."""

    def __init__(self, tokenizer, pieces):
        from types import SimpleNamespace

        from sparseserve.spec_decode.metrics import SpecDecodeMetrics

        self.tokenizer, self.pieces = tokenizer, pieces
        self.engine = SimpleNamespace(max_model_len=4096, vocab_size=512, spec_metrics=SpecDecodeMetrics())
        self.is_running, self.error = True, None

    def validate(self, prompt, params):
        return prompt.get("prompt"), prompt["prompt_token_ids"]

    def stats(self):
        from sparseserve.engine.async_engine import EngineStats
        return EngineStats(0, 0, 0.0, 1, 1, 1, 1)

    async def generate(self, prompt, params, request_id):
        from sparseserve.outputs import CompletionOutput, RequestOutput
        from sparseserve.sampling_params import RequestOutputKind

        ids = prompt["prompt_token_ids"]
        pieces = self.pieces if params.output_kind is RequestOutputKind.DELTA else ["".join(self.pieces)]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            tokens = [7] * (1 if params.output_kind is RequestOutputKind.DELTA else len(self.pieces))
            yield RequestOutput(request_id, None, ids, [CompletionOutput(0, piece, tokens, None, None,
                                                                         "stop" if last else None)], last)


def test_streamed_tool_calls_and_reasoning_over_http(tmp_path):
    import re

    from transformers import AutoTokenizer

    from sparseserve.entrypoints.openai.api_server import ServerThread, build_app

    D = "｜DSML｜"
    text = (f"Need the weather.</think>Let me check.\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
            f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n"
            f"<{D}parameter name=\"days\" string=\"false\">3</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
    pieces = re.findall(r"<｜|｜>|\w+|\s|.", text)
    tokenizer = AutoTokenizer.from_pretrained(str(write_v4_tokenizer(tmp_path / "tok")))
    port = free_port()
    server = ServerThread(build_app(_ScriptedEngine(tokenizer, pieces), ["v4"]), "127.0.0.1", port)
    server.start()
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        kw = dict(model="v4", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                  extra_body={"chat_template_kwargs": {"thinking": True}})
        whole = c.chat.completions.create(**kw)
        msg = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls"
        assert msg.content == "Let me check." and msg.model_extra["reasoning_content"] == "Need the weather."
        assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
            ("get_weather", {"city": "Paris", "days": 3})]
        reasoning, content, calls, finish = "", "", {}, None
        for chunk in c.chat.completions.create(**kw, stream=True):
            delta = chunk.choices[0].delta
            assert D not in (delta.content or "") and "</think>" not in (delta.content or "")
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for t in delta.tool_calls or []:
                call = calls.setdefault(t.index, {"name": "", "arguments": ""})
                call["name"] += t.function.name or ""
                call["arguments"] += t.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert (reasoning, content, finish) == ("Need the weather.", "Let me check.", "tool_calls")
        assert [(v["name"], json.loads(v["arguments"])) for v in calls.values()] == [
            ("get_weather", {"city": "Paris", "days": 3})]
    finally:
        server.stop()


def test_chat_response_format_json_schema(tmp_path):
    """response_format json_schema constrains the reply (structured outputs): it parses and validates."""
    import jsonschema

    tok_dir = write_v4_tokenizer(tmp_path / "v4tok")
    llm = LLM(TINY, tokenizer=str(tok_dir), **ENGINE)
    schema = {"type": "string", "enum": ["yes", "no"]}
    with running_server(llm.llm_engine) as (url, engine):
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        reply = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Yes or no?"}], max_tokens=12, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        bad = httpx.post(url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}})
        assert bad.status_code == 400 and "response_format" in bad.json()["error"]["message"]
