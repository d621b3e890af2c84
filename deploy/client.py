#!/usr/bin/env python3
"""Stream a completion from the LiLiCorr Triton server over gRPC and print it as it arrives.

    python deploy/client.py --url 127.0.0.1:8001 "Write a haiku about lattices"
    python deploy/client.py --url 127.0.0.1:8001 --rule ar --max-tokens 64 "..."
    python deploy/client.py --url 127.0.0.1:8001 --messages chat.json        # [{"role","content"}...]
    python deploy/client.py --url 127.0.0.1:8001 --ids 1,4,7,9                # token ids -> `lilicorr` model

Statistics (tokens, accepted/drafted, tau, TTFT, per-token latency) go to stderr with --stats.
Exit code 2 when the server rejects the request (its message names the request id).
"""
from __future__ import annotations

import argparse
import json
import sys

from lilicorr.serving.client import GenerationError, LiLiCorrClient


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="user message (the chat template is applied server-side)")
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC HOST:PORT of the server")
    p.add_argument("--messages", help="JSON file with a chat list of {role, content}")
    p.add_argument("--ids", help="comma-separated prompt token ids (sent to the `lilicorr` model directly)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--rule", dest="decode_rule", default=None, help="lilicorr | viterbi | argmax | ar | tree")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-stream", action="store_true", help="ask for a single response at the end")
    p.add_argument("--model", default=None, help="ensemble (text) or lilicorr (token ids)")
    p.add_argument("--stats", action="store_true", help="print counts and latencies to stderr")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)

    kwargs = dict(max_tokens=args.max_tokens, decode_rule=args.decode_rule, temperature=args.temperature,
                  seed=args.seed, stream=not args.no_stream, model=args.model)
    if args.ids:
        kwargs["input_ids"] = [int(x) for x in args.ids.replace(" ", "").split(",") if x]
    elif args.messages:
        with open(args.messages, encoding="utf-8") as f:
            kwargs["messages"] = json.load(f)
    elif args.prompt is not None:
        kwargs["prompt"] = args.prompt
    else:
        kwargs["prompt"] = sys.stdin.read()

    client = LiLiCorrClient(args.url, timeout=args.timeout)
    try:
        with client.stream(**kwargs) as gs:
            for delta in gs:
                if delta.text:
                    sys.stdout.write(delta.text)
                elif delta.token_ids and "input_ids" in kwargs:
                    sys.stdout.write("".join(f" {t}" for t in delta.token_ids))
                sys.stdout.flush()
            res = gs.result()
    except GenerationError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\n[cancelled]", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    if args.stats:
        tpot = f"{1e3 * res.tpot:.1f} ms" if res.tpot is not None else "n/a"
        ttft = f"{1e3 * res.ttft:.1f} ms" if res.ttft is not None else "n/a"
        print(f"[{res.request_id}] {res.num_tokens} tokens, finish={res.finish_reason}, "
              f"accepted={res.accepted} drafted={res.drafted} steps={res.steps} tau={res.tau:.2f}, "
              f"ttft={ttft}, per-token={tpot}, total={res.latency:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
