"""``%generate --in prompts.jsonl --out replies.jsonl``: many prompts through the continuous batch, with a progress bar.

Each input line is a JSON string (one user message), ``{"prompt": "..."}`` or ``{"messages": [...]}``. Each
output line is ``{"index", "text", "finish_reason", "prompt_tokens", "generated_tokens"}``, written as the reply
finishes (so in finishing order); an interrupt stops the rest and keeps the finished replies in the file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from shardbook.kernel.ranks.runtime import get_runtime
from shardbook.magics.arguments import parse_line
from shardbook.magics.chat import generation_options


def read_prompts(path: Path) -> list:
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{number}: not JSON: {e}") from None
        if isinstance(item, dict):
            item = item.get("messages", item.get("prompt"))
        if not (isinstance(item, str) or isinstance(item, list) and item and isinstance(item[0], dict)):
            raise UsageError(f'{path}:{number}: expected a string, {{"prompt": ...}} or {{"messages": [...]}}')
        prompts.append(item)
    return prompts


@magics_class
class GenerateMagics(Magics):
    """Replies to a file of prompts, decoded together."""

    @magic_arguments()
    @argument("--in", dest="inp", required=True, metavar="FILE", help="prompts, one JSON value per line")
    @argument("--out", required=True, metavar="FILE", help="replies, one JSON object per line")
    @argument("--stop", action="append", default=None, help="a stop string (repeat for more)")
    @generation_options
    @line_magic
    def generate(self, line: str):
        """Generate a reply to every prompt of --in, decoded together in the continuous batch, into --out."""
        # imported on first use: it brings in transformers, which the kernel's start need not wait for
        from shardbook.kernel.api.batch import sequence_request

        args = parse_line(self.generate, line)
        prompts = read_prompts(Path(args.inp))
        settings = {
            "max_new_tokens": args.max_new_tokens,
            "do_sample": args.do_sample,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "repetition_penalty": args.repetition_penalty,
            "seed": args.seed,
        }
        runtime = get_runtime(self.shell)
        requests = [sequence_request(runtime, p, chat=True, stop=args.stop, **settings) for p in prompts]
        return run_to_file(runtime, requests, Path(args.out))


def run_to_file(runtime, requests: list, out: Path) -> dict:
    from tqdm.auto import tqdm

    from shardbook.kernel.api.batch import submit

    handles = [submit(runtime, r) for r in requests]
    written, pending = 0, set(range(len(handles)))
    bar = tqdm(total=len(handles), desc="replies", unit="reply")
    with out.open("w", encoding="utf-8") as f:

        def flush_done(keep_interrupted: bool) -> None:
            nonlocal written
            for i in sorted(pending):
                if handles[i].done.is_set():
                    pending.discard(i)
                    result = handles[i].result
                    bar.update(1)
                    if result.finish_reason == "interrupted" and not keep_interrupted:
                        continue
                    row = {
                        "index": i,
                        "text": result.text,
                        "finish_reason": result.finish_reason,
                        "prompt_tokens": result.prompt_tokens,
                        "generated_tokens": result.generated_tokens,
                    }
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                    f.flush()
                    written += 1

        try:
            while pending:
                flush_done(keep_interrupted=True)
                time.sleep(0.05)
        except KeyboardInterrupt:
            for handle in handles:
                handle.stop()
            for handle in handles:
                handle.done.wait(60)
            flush_done(keep_interrupted=False)
            bar.close()
            print(f"interrupted: {written} finished replies written to {out}")
            return {"written": written, "interrupted": True}
    bar.close()
    print(f"{written} replies written to {out}")
    return {"written": written, "interrupted": False}
