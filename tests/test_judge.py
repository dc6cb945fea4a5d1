"""The LLM-judge client against a small OpenAI-compatible FastAPI server run in-process on 127.0.0.1."""

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from openrlhf_search.evaluation.judge import JudgeClient, JudgeError, build_judge_messages


class FakeJudgeServer:
    """``/v1/chat/completions`` that answers True when the predicted answer equals a golden answer (case-folded).

    Questions containing "flaky" fail with HTTP 500 on their first request; "broken" always fails; "refuse" gets 400.
    Records calls and the peak number of requests in flight.
    """

    def __init__(self, delay_s: float = 0.05):
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.seen_flaky = set()
        self.bodies = []
        self.delay_s = delay_s
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request):
            body = await request.json()
            self.calls += 1
            self.bodies.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.delay_s)
                user = body["messages"][-1]["content"]
                fields = dict(line.split(": ", 1) for line in user.splitlines() if ": " in line)
                q = fields["Question"]
                if "broken" in q:
                    return JSONResponse({"error": "down"}, status_code=500)
                if "refuse" in q:
                    return JSONResponse({"error": "bad request"}, status_code=400)
                if "flaky" in q and q not in self.seen_flaky:
                    self.seen_flaky.add(q)
                    return JSONResponse({"error": "overloaded"}, status_code=500)
                if "Golden answer(s)" in fields:  # the "strict" prompt
                    golds = [g.strip().lower() for g in fields["Golden answer(s)"].split("|")]
                    predicted = fields["Predicted answer"]
                else:  # R1-Searcher's released prompt: one gold answer
                    golds = [fields["Golden Answer"].strip().lower()]
                    predicted = fields["Predicted Answer"]
                verdict = predicted.strip().lower() in golds
                return {"id": "x", "object": "chat.completion", "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": str(verdict)}}]}
            finally:
                self.in_flight -= 1

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("fake judge server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture()
def judge_server():
    with FakeJudgeServer() as srv:
        yield srv


ITEMS = [(f"question {i}", [f"gold {i}", f"alias {i}"], f"gold {i}" if i % 3 else f"wrong {i}") for i in range(12)]


def test_judge_verdicts_concurrency_and_cache(judge_server, tmp_path):
    cache = str(tmp_path / "judge.sqlite")

    async def go(concurrency):
        client = JudgeClient(judge_server.url, model="judge-test", concurrency=concurrency, cache_path=cache,
                             backoff_s=0.01)
        try:
            return await client.judge_many(ITEMS), dict(client.stats)
        finally:
            await client.aclose()

    verdicts, stats = asyncio.run(go(4))
    assert [v.correct for v in verdicts] == [bool(i % 3) for i in range(12)]
    assert judge_server.calls == 12 and stats["requests"] == 12
    assert 1 < judge_server.max_in_flight <= 4  # concurrent, and capped
    body = judge_server.bodies[0]
    assert body["model"] == "judge-test" and body["temperature"] == 0.0
    assert "Question: question" in body["messages"][-1]["content"]

    # second run, new client, same cache file: no request at all
    verdicts2, stats2 = asyncio.run(go(4))
    assert [v.correct for v in verdicts2] == [v.correct for v in verdicts]
    assert all(v.cached for v in verdicts2) and stats2["cache_hits"] == 12
    assert judge_server.calls == 12


def test_judge_retries_after_500_and_reports_failures(judge_server):
    async def go():
        client = JudgeClient(judge_server.url, concurrency=8, max_retries=2, backoff_s=0.01)
        try:
            flaky = await client.judge("a flaky question", ["Paris"], "paris")
            many = await client.judge_many([("broken one", ["x"], "x"), ("fine", ["y"], "y")])
            with pytest.raises(JudgeError, match="HTTP 400"):
                await client.judge("please refuse", ["z"], "z")
            with pytest.raises(JudgeError, match="after 3 attempts"):
                await client.judge("broken again", ["z"], "z")
            return flaky, many, dict(client.stats)
        finally:
            await client.aclose()

    flaky, many, stats = asyncio.run(go())
    assert flaky.correct is True and stats["retries"] >= 1
    assert many[0].correct is None and "HTTP 500" in many[0].raw  # kept as unjudged, the other one survives
    assert many[1].correct is True
    assert stats["failures"] == 1


def test_judge_empty_prediction_and_bad_url(judge_server):
    async def go():
        client = JudgeClient(judge_server.url + "/v1")
        try:
            return await client.judge("q", ["a"], "  ")
        finally:
            await client.aclose()

    v = asyncio.run(go())
    assert v.correct is False and judge_server.calls == 0
    with pytest.raises(ValueError):
        JudgeClient("127.0.0.1:8000")
    msgs = build_judge_messages("Who?", ["A", "B"], "A")
    assert msgs[-1]["content"].count("Golden answer(s): A | B") == 1


def test_judge_client_survives_several_event_loops(judge_server):
    """One client used from successive asyncio.run calls (the CLI judges each dataset in turn) and closed in another."""
    client = JudgeClient(judge_server.url, concurrency=4)
    first = asyncio.run(client.judge_many(ITEMS[:4]))
    second = asyncio.run(client.judge_many(ITEMS[4:8]))
    asyncio.run(client.aclose())
    assert [v.correct for v in first + second] == [bool(i % 3) for i in range(8)]
    assert judge_server.calls == 8


def test_judge_unreachable_endpoint_fails_cleanly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go():
        client = JudgeClient(f"http://127.0.0.1:{port}", max_retries=1, backoff_s=0.01, timeout_s=2)
        try:
            return await client.judge_many([("q", ["a"], "a")]), client.stats
        finally:
            await client.aclose()

    verdicts, stats = asyncio.run(go())
    assert verdicts[0].correct is None and "ConnectError" in verdicts[0].raw and stats["failures"] == 1


def test_rescore_cli_with_judge(judge_server, tmp_path):
    """--judge_url on --rescore re-judges every prediction and keeps the file's own labels beside."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    rows = [{"question": f"q{i}", "answer": f"ans {i}", "pred_ans": f"ans {i}" if i < 3 else "nope",
             "gen_text_store": "", "gpt4o_output": "True"} for i in range(5)]
    path = tmp_path / "eval_results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, "-m", "openrlhf_search.cli.eval", "--rescore", str(path), "--summary_json",
                           str(out), "--judge_url", judge_server.url, "--judge_model", "local"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    s = json.loads(out.read_text())
    assert s["judge_acc"] == pytest.approx(3 / 5) and s["judge_acc_file"] == pytest.approx(1.0)
    assert s["judge_stats"]["requests"] == 5
    # R1-Searcher's released judge request (metric_calc_gpt_as_judge.py:31-38, 90): one user message, 1,024 tokens,
    # no temperature (the server's default)
    body = judge_server.bodies[0]
    assert len(body["messages"]) == 1 and body["messages"][0]["role"] == "user"
    assert body["max_tokens"] == 1024 and "temperature" not in body
    assert body["messages"][0]["content"].startswith("Given a Question and its Golden Answer, verify whether")
    assert s["setup"]["judge"] == "local (r1searcher prompt)"
