"""A short soak of `lowbit serve` as a process (the driver of ``python -m benchmarks soak`` at
a small size, on the tiny GGUF model): every hostile kind of client at once with well-behaved
ones, and not one 5xx, wrong answer or lost answer; the server still answers afterwards, holds
no slot, logged no exception and exits 0 on SIGTERM. No timing is asserted."""

import os
import sys
from pathlib import Path

from server_support import ARCH, write_tiny_gguf

from lowbit import serving
from lowbit.models._generate import generate_tokens

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the benchmarks package sits beside lowbit, outside the install

from benchmarks._soak_driver import (  # noqa: E402
    MIX,
    Settings,
    Soak,
    free_port,
    server_log_errors,
    start_server,
    stop_server,
)

MAX_BODY_BYTES = 16384
# At most 31 bytes (one token a byte): each is prefilled in one pass, as generate_tokens does.
PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "hello",
    "A soak test for the server",
    "1 2 3 4 5 6 7 8",
    "What is the capital of France?",
]
SETTINGS = Settings(
    clients=8,
    requests=120,
    baseline=0,
    max_tokens=(3, 6),
    burst=12,  # over the 2 slots and 8 places in the queue
    max_body_bytes=MAX_BODY_BYTES,
    rss_at=30,
    timeout=60,
    retries=100,
)


def test_a_short_soak_gets_no_5xx_and_no_wrong_or_lost_answer(tmp_path):
    model = write_tiny_gguf(ARCH, tmp_path / "tiny.gguf")
    port = free_port()
    command = [
        sys.executable, "-c", "import sys; from lowbit.cli import console; console()",
        "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--slots", "2",
        "--max-len", "64", "--prefill-chunk", "32", "--queue", "8",
        "--max-body-bytes", str(MAX_BODY_BYTES), "--read-timeout", "20", "--deterministic",
    ]  # fmt: skip
    log = tmp_path / "server.log"
    proc = start_server(command, port, log, dict(os.environ, PYTHONPATH=str(ROOT)), ROOT, 240)
    try:
        soak = Soak(port, proc, PROMPTS, SETTINGS)
        references = soak.compute_references()
        result = soak.run_phase(SETTINGS.requests)
    finally:
        exit_status = stop_server(proc)
    problems = result["failures"]
    assert result["server_errors"] == 0, problems
    assert result["wrong"] == 0 and result["lost"] == 0, problems
    assert set(result["statuses"]) == set(MIX), result["statuses"]  # every kind was sent
    assert result["well_behaved"] > 0
    assert result["alive"] and result["health"] == 200
    assert result["drained"], "a request still held a slot or a place in the queue"
    assert server_log_errors(log) == [], log.read_text()[-3000:]
    assert exit_status == 0, log.read_text()[-3000:]

    # The references the answers were checked against are generate_tokens' greedy answers.
    loaded = serving.load_model(str(model))
    for (p, n), answer in references.items():
        prompt = loaded.tokenizer.encode(PROMPTS[p]).ids
        tokens = generate_tokens(loaded.model, [prompt], max_new_tokens=n).tokens[0]
        assert list(answer.ids) == tokens[: len(answer.ids)], (p, n)
        # Shorter only when the next token is a stop token.
        assert (answer.finish == "length") == (len(answer.ids) == n), (p, n, answer)
