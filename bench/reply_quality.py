"""Reply quality with the app's chat defaults: do first replies loop, run to the length limit, or read well?

Each prompt is a fresh chat on the default model and build, sampled as the desktop app samples it: a fresh
install's AppSettings over the model's ChatDefaults (engine.run.generation), the same code the app's worker
runs. A reply "loops" when some word 4-gram occurs 4 or more times in it; it is "cut" when it stopped at
max new tokens instead of ending by itself.

    python bench/reply_quality.py                       # the 20 bench prompts: app defaults vs old greedy
    python bench/reply_quality.py --set tune --config '{"temperature": 0.7, "repeat_penalty": 1.1}' ...

The defaults were chosen on --set tune, never on the bench prompts. Prints a table, writes JSON and the
replies as Markdown for a person to read; the committed runs (docs/QUALITY.md) used
    --seeds 1 2 3 --json docs/quality/replies/bench.json --replies-dir docs/quality
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import cpu_info  # noqa: E402  (bench/machine.py, beside this script)

from app.settings import AppSettings  # noqa: E402  (the app's settings: the point is to use its path)
from engine.run.generation import sampling_params  # noqa: E402
from engine.loader import open_model  # noqa: E402

# The bench set: everyday requests in four kinds. Fixed: changing one makes figures incomparable.
BENCH_PROMPTS = [
    ("writing", "Write a haiku about the sea, then explain it in two sentences."),
    ("writing", "Write a short, friendly email inviting my neighbours to a garden party on Saturday."),
    ("writing", "Write a four-line poem about autumn leaves."),
    ("writing", "Give me three ideas for a name for a small bakery, with one sentence on each."),
    ("writing", "Write a two-sentence horror story."),
    ("facts", "What is the capital of France?"),
    ("facts", "Why is the sky blue? Answer in a short paragraph."),
    ("facts", "How many planets are in the solar system? Name them."),
    ("facts", "Who wrote Romeo and Juliet, and roughly when?"),
    ("facts", "What is photosynthesis, in simple words?"),
    ("code", "Write a Python function that reverses a string."),
    ("code", "How do I read a text file line by line in Python?"),
    ("code", "Explain what a for loop is to a beginner, with a short example."),
    ("code", "Write a SQL query that counts the rows of a table called orders."),
    ("code", "What is the difference between a list and a tuple in Python?"),
    ("advice", "How can I sleep better? Give me five tips."),
    ("advice", "I have a job interview tomorrow. How should I prepare?"),
    ("advice", "How do I start learning to play the guitar?"),
    ("advice", "What is a simple healthy breakfast I can make in five minutes?"),
    ("advice", "How can I save money on groceries?"),
]

# The tuning set: the defaults were chosen on these, so the bench set above measures them unseen.
TUNE_PROMPTS = [
    ("writing", "Write a limerick about a cat who loves coffee."),
    ("writing", "Describe a rainy city street in three sentences."),
    ("writing", "Write a thank-you note to a teacher."),
    ("facts", "What causes the seasons on Earth?"),
    ("facts", "What is the tallest mountain in the world and how tall is it?"),
    ("facts", "Explain what a black hole is."),
    ("code", "Write a Python function that checks whether a number is prime."),
    ("code", "What does the git command 'git status' do?"),
    ("code", "Write a JavaScript function that adds two numbers."),
    ("advice", "How can I stay focused while studying?"),
    ("advice", "Give me tips for a long car trip with children."),
    ("advice", "How do I make a good cup of tea?"),
]

# The app's defaults before issue 10: greedy, no penalty (what every settings file of version 1 held).
OLD_GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
              "presence_penalty": 0.0, "frequency_penalty": 0.0, "repeat_last_n": 64}


def loops(text: str, n: int = 4, times: int = 4) -> bool:
    """True if some word n-gram occurs `times` or more times (punctuation and case ignored)."""
    words = re.findall(r"\w+", text.lower())
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    return any(c >= times for c in grams.values())


def run_config(model, label: str, overrides: dict | None, prompts: list, seeds: list[int], max_new: int) -> dict:
    """One configuration over every prompt and seed; `overrides` None means the app's own defaults."""
    app = AppSettings.of(max_new_tokens=max_new)
    base = app.chat_settings(model.chat_defaults)
    sampling = sampling_params(model.chat_defaults, overrides) if overrides is not None else base.sampling
    # Greedy decoding ignores the seed: one pass stands for every seed.
    seeds = seeds[:1] if sampling.temperature == 0 else seeds
    session = model.chat(base)
    replies = []
    for seed in seeds:
        for kind, prompt in prompts:
            session.settings.sampling = replace(sampling, seed=seed)
            session.reset()
            start = time.perf_counter()
            result = session.answer(prompt)
            replies.append({"seed": seed, "kind": kind, "prompt": prompt, "reply": result.text,
                            "tokens": result.tokens, "stop": result.stop_reason, "loops": loops(result.text),
                            "seconds": round(time.perf_counter() - start, 2)})
            print(f"  {label} seed {seed} [{kind}] {result.tokens:4d} tokens {result.stop_reason:6s} "
                  f"{'LOOP' if replies[-1]['loops'] else ''}", file=sys.stderr, flush=True)
    n = len(replies)
    settings = {k: v for k, v in asdict(sampling).items() if k != "seed"}
    return {"label": label, "settings": settings, "seeds": seeds, "replies": replies, "n": n,
            "looping": sum(r["loops"] for r in replies), "cut": sum(r["stop"] == "length" for r in replies),
            "median_tokens": statistics.median(r["tokens"] for r in replies)}


def write_replies(path: Path, result: dict, model_name: str) -> None:
    lines = [f"# Replies: {result['label']}", "",
             f"Model {model_name}; settings {json.dumps(result['settings'])}; seeds {result['seeds']}; "
             f"{result['looping']} of {result['n']} loop, {result['cut']} cut at max tokens, median "
             f"{result['median_tokens']} tokens. Written by bench/reply_quality.py.", ""]
    for r in result["replies"]:
        flags = ", ".join(f for f, on in (("loops", r["loops"]), ("cut at max tokens", r["stop"] == "length")) if on)
        lines += [f"## seed {r['seed']} · {r['kind']} · {r['prompt']}", "",
                  f"*{r['tokens']} tokens, ended by {r['stop']}{'; ' + flags if flags else ''}*", ""]
        lines += ["> " + line if line else ">" for line in r["reply"].strip().splitlines()] or [">"]
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=("bench", "tune"), default="bench")
    ap.add_argument("--config", action="append", default=None,
                    help='"app" (the app\'s defaults), "greedy" (the old defaults) or a JSON object of sampling '
                         "overrides over the model's defaults; repeatable (default: app and greedy)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--model", default=None, help="default: the app's default model")
    ap.add_argument("--json", default=None, help="write every reply and the summary here")
    ap.add_argument("--replies-dir", default=None, help="write replies-<label>.md for each config here")
    a = ap.parse_args()

    prompts = BENCH_PROMPTS if a.set == "bench" else TUNE_PROMPTS
    model = open_model(a.model, AppSettings().build_settings())
    results = []
    for spec in a.config or ["app", "greedy"]:
        overrides = None if spec == "app" else OLD_GREEDY if spec == "greedy" else json.loads(spec)
        label = spec if spec in ("app", "greedy") else ",".join(f"{k}={v}" for k, v in overrides.items())
        results.append(run_config(model, label, overrides, prompts, a.seeds, a.max_new_tokens))

    name = model.source.name if model.source else "?"
    print(f"\nreply quality: {name}, {a.set} set ({len(prompts)} prompts), max new tokens {a.max_new_tokens}")
    print(f"model defaults: {model.chat_defaults.describe()}")
    print(f"{'config':58s} {'replies':>7s} {'looping':>8s} {'cut':>6s} {'median tok':>10s}")
    for r in results:
        print(f"{r['label'][:58]:58s} {r['n']:7d} {r['looping']:8d} {r['cut']:6d} {r['median_tokens']:10.0f}")
    for r in results:
        print(f"  {r['label']}: {json.dumps(r['settings'])}")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": name, "set": a.set, "max_new_tokens": a.max_new_tokens,
                                            "build": model.engine.settings.to_dict(), "cpu": cpu_info(),
                                            "chat_defaults": model.chat_defaults.to_dict(), "results": results},
                                           indent=1, ensure_ascii=False))
    if a.replies_dir:
        out = Path(a.replies_dir)
        out.mkdir(parents=True, exist_ok=True)
        for r in results:
            write_replies(out / f"replies-{a.set}-{re.sub(r'[^a-z0-9.=_-]+', '_', r['label'].lower())}.md", r, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
