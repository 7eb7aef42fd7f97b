"""Time to first token of a /v1 stream against the prefill it waits for, with the official `openai` client.

Alternates, round by round, on one idle server: (a) a non-streamed completion of one token (the prompt's
prefill, the first draw, the HTTP round trip) and (b) a streamed completion of `--tokens` tokens, timing
its first token chunk and its last. A stream that sends tokens as they are drawn has (b)'s first chunk
within about one decode step of (a); one sent whole at the end has it at (b)'s last. Prints the medians
and their ratios. Seeded sampling at temperature 1, the same seed every round.

Usage (repo root, a server started with `make serve` or `loraplex serve --port 8000`):
    .venv/bin/python bench/stream_latency.py --base-url http://127.0.0.1:8000/v1 [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai


def one_token(client: openai.OpenAI, model: str, prompt: str) -> float:
    """Seconds for a non-streamed completion of one token."""
    start = time.perf_counter()
    client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=1.0, seed=1)
    return time.perf_counter() - start


def streamed(client: openai.OpenAI, model: str, prompt: str, tokens: int) -> tuple[float, float, int]:
    """Seconds to the first token chunk and to the end of a stream of `tokens`; the chunks received."""
    start = time.perf_counter()
    first, chunks = None, 0
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=tokens, temperature=1.0, seed=1, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason is None:
            first = time.perf_counter() - start if first is None else first
            chunks += 1
    assert first is not None, "the stream sent no token"
    return first, time.perf_counter() - start, chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="tml-local")
    parser.add_argument("--prompt-repeats", type=int, default=20, help="'Once upon a time, ' this many times")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = client.models.list().data[0].id
    prompt = "Once upon a time, " * args.prompt_repeats
    one_token(client, model, prompt), streamed(client, model, prompt, args.tokens)  # warm-up
    ones, firsts, lasts = [], [], []
    for _ in range(args.rounds):
        ones.append(one_token(client, model, prompt))
        first, last, chunks = streamed(client, model, prompt, args.tokens)
        firsts.append(first)
        lasts.append(last)
    one, first, last = (1e3 * statistics.median(v) for v in (ones, firsts, lasts))
    print(f"model {model}, prompt {len(prompt)} characters, {args.tokens} tokens, {args.rounds} rounds")
    print(f"one-token completion (prefill + first draw): median {one:.1f} ms")
    print(f"stream: first token chunk median {first:.1f} ms, last {last:.1f} ms ({chunks} token chunks)")
    print(f"first chunk / one-token completion: {first / one:.2f}; first chunk / last: {first / last:.3f}")


if __name__ == "__main__":
    main()
