"""Load test of `transformer serve`: concurrent clients against one sentence at a time.

    transformer serve --checkpoint runs/multi30k_de_en/checkpoints/best.pt &
    python scripts/load_test_serve.py --url http://127.0.0.1:8000 \
        --source ../shared/data/multi30k/test_2016_flickr.de.gz --clients 8 --requests 400

1. One client sends each distinct sentence alone, one request after the other: sentences/s of an unbatched
   server, and the reference translation of every sentence.
2. `--clients` clients send `--requests` requests of 1-4 sentences (seeded), concurrently, each client one request
   at a time. Every response must hold as many translations as its request had sentences (else "lost"), each equal
   to that sentence's reference translation (else "mismatched": a reordered or mixed-up batch shows up here).

Prints requests, errors, lost and mismatched sentences, latency p50/p95 (milliseconds), sentences/s of both phases
and their ratio; `--json FILE` writes the same figures. Only 127.0.0.1/localhost URLs are accepted. Exits 1 if
any request failed, or any sentence was lost or mismatched.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx


def read_sentences(path: str, limit: int) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[:limit]


def make_requests(n_sentences: int, n_requests: int, seed: int) -> list[list[int]]:
    """`n_requests` lists of 1-4 sentence indices, cycling through the sentences in order."""
    rng = random.Random(seed)
    requests, next_index = [], 0
    for _ in range(n_requests):
        size = rng.randint(1, 4)
        requests.append([(next_index + i) % n_sentences for i in range(size)])
        next_index += size
    return requests


async def post(client: httpx.AsyncClient, sentences: list[str], options: dict) -> tuple[list[str], float]:
    start = time.perf_counter()
    response = await client.post("/translate", json={"text": sentences, **options})
    response.raise_for_status()
    return response.json()["translations"], (time.perf_counter() - start) * 1000


async def one_at_a_time(url: str, sentences: list[str], options: dict, timeout: float) -> tuple[list[str], float]:
    """Each sentence in its own request, one after the other: (translations, seconds)."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        start = time.perf_counter()
        translations = [(await post(client, [s], options))[0][0] for s in sentences]
        return translations, time.perf_counter() - start


async def concurrent(url: str, sentences: list[str], requests: list[list[int]], clients: int, options: dict,
                     reference: list[str], timeout: float) -> dict:
    """`clients` clients share the requests (client c sends requests c, c + clients, ...)."""
    latencies: list[float] = []
    counts = {"errors": 0, "lost": 0, "mismatched": 0, "sentences": 0}
    examples: list[str] = []

    async def client_loop(client: httpx.AsyncClient, mine: list[list[int]]) -> None:
        for indices in mine:
            try:
                translations, ms = await post(client, [sentences[i] for i in indices], options)
            except (httpx.HTTPError, KeyError, ValueError) as err:
                counts["errors"] += 1
                examples.append(f"error: {err}")
                continue
            latencies.append(ms)
            counts["sentences"] += len(indices)
            counts["lost"] += abs(len(indices) - len(translations))
            for i, text in zip(indices, translations):
                if text != reference[i]:
                    counts["mismatched"] += 1
                    examples.append(f"sentence {i}: {text!r} != {reference[i]!r}")

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client, requests[c::clients]) for c in range(clients)))
        seconds = time.perf_counter() - start
    latencies.sort()
    return {**counts, "requests": len(requests), "seconds": seconds,
            "p50_ms": statistics.median(latencies) if latencies else None,
            "p95_ms": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))] if latencies else None,
            "examples": examples[:5]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--source", required=True, help="sentences, one per line (plain or .gz)")
    parser.add_argument("--sentences", type=int, default=1000, help="distinct sentences used (default 1000)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--beam-size", type=int, help="default: the server's")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if urlparse(args.url).hostname not in ("127.0.0.1", "localhost"):
        parser.error("--url: this load test runs against 127.0.0.1 (or localhost) only")
    options = {"beam_size": args.beam_size} if args.beam_size else {}
    requests = make_requests(args.sentences, args.requests, args.seed)
    used = sorted({i for r in requests for i in r})
    sentences = read_sentences(args.source, args.sentences)
    if len(sentences) < args.sentences:
        parser.error(f"--source has {len(sentences)} non-empty lines; --sentences asks for {args.sentences}")

    health = httpx.get(args.url + "/health", timeout=args.timeout).json()
    translations, alone_s = asyncio.run(one_at_a_time(args.url, [sentences[i] for i in used], options, args.timeout))
    reference = dict(zip(used, translations))
    load = asyncio.run(concurrent(args.url, sentences, requests, args.clients, options,
                                  [reference.get(i, "") for i in range(len(sentences))], args.timeout))
    after = httpx.get(args.url + "/health", timeout=args.timeout).json()["batching"]
    batched = {k: after[k] - health["batching"][k] for k in ("sentences", "batches")}
    # the server's decoding calls during phase 2: all of them minus phase 1's one per sentence
    load_batches = batched["batches"] - len(used)
    figures = {
        "model": health["model"]["checkpoint"], "device": health["device"],
        "beam_size": args.beam_size or health["decoding"]["beam_size"], "clients": args.clients,
        "sentences_sent": sum(len(r) for r in requests),
        "one_at_a_time_sentences": len(used), "one_at_a_time_sentences_per_s": len(used) / alone_s,
        **{k: v for k, v in load.items() if k != "examples"},
        "sentences_per_s": load["sentences"] / load["seconds"],
        "speedup_over_one_at_a_time": (load["sentences"] / load["seconds"]) / (len(used) / alone_s),
        "batches": load_batches,
        "mean_batch_sentences": (batched["sentences"] - len(used)) / load_batches if load_batches > 0 else 0.0,
    }
    print(f"{figures['model']} on {figures['device']}, beam {figures['beam_size']}")
    print(f"one client, one sentence per request: {len(used)} sentences, "
          f"{figures['one_at_a_time_sentences_per_s']:.1f} sentences/s")
    print(f"{args.clients} clients, {load['requests']} requests of 1-4 sentences: {load['sentences']} sentences in "
          f"{load['seconds']:.1f} s, {figures['sentences_per_s']:.1f} sentences/s "
          f"({figures['speedup_over_one_at_a_time']:.2f}x one at a time); latency p50 {load['p50_ms']:.0f} ms, "
          f"p95 {load['p95_ms']:.0f} ms; mean batch {figures['mean_batch_sentences']:.1f} "
          "sentences")
    print(f"errors {load['errors']}, lost {load['lost']}, mismatched {load['mismatched']}")
    for example in load["examples"]:
        print("  " + example)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if load["errors"] or load["lost"] or load["mismatched"] else 0


if __name__ == "__main__":
    sys.exit(main())
