"""`lowbit serve` as a process: its flags (a draft model among them) reach the server;
SIGTERM lets the running request finish, then exits 0."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from server_support import ARCH, connect, free_port, read_to_close, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_drains_the_running_request_and_exits_0(tmp_path):
    model = write_tiny_gguf(ARCH, tmp_path / "tiny.gguf")
    port = free_port()
    command = [
        sys.executable, "-c", "import sys; from lowbit.cli import console; console()",
        "serve", str(model), "--port", str(port), "--slots", "2", "--max-len", "64",
        "--prefill-chunk", "16", "--grace", "20", "--max-body-bytes", "2048", "--embeddings",
        "--speculate", str(model),  # a draft model: the file itself
    ]  # fmt: skip
    log = open(tmp_path / "log.txt", "w+")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.2)
        with connect(url) as sock:  # --max-body-bytes: refused from the declared length
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2049\r\n\r\n"
            )
            answer = read_to_close(sock)
        assert answer.startswith(b"HTTP/1.1 413") and b"2048 bytes" in answer, answer
        r = httpx.post(f"{url}/v1/embeddings", json={"input": ["a", "b"]}, timeout=60)
        assert r.status_code == 200 and len(r.json()["data"]) == 2, r.text  # --embeddings
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "lowbit_speculation_drafted_tokens_total" in metrics  # --speculate MODEL
        body = {"prompt": "drain", "max_tokens": 40, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                if not events:
                    proc.send_signal(signal.SIGTERM)  # mid-request
                events.append(line)
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] in ("length", "stop")
        assert proc.wait(60) == 0, (tmp_path / "log.txt").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
