"""How each policy's answers go wrong on a task whose answers are identifiers (RULER's multikey_3: uuids).

Run: python benchmarks/wrong_answers.py --store results/lmeval-ruler-qwen-4k-fresh.sqlite \
         --data runs/lmeval-ruler-qwen-4k-fresh.jsonl --task niah_multikey_3

Only the requests the full cache answers right count. Each other policy's answer there is one of: ``right``;
``another of the context`` (an identifier the context holds, not the asked one: the asked line was lost or misread);
``not in the context`` (an identifier found nowhere in it: some value's tokens partly evicted, the rest completed by
the model; its characters shared with the right answer, position by position, are printed: far above chance, the
asked value was cut, at chance another; two random uuids share ~6 of 36, the four dashes and 2 of 32 hex digits);
``none`` (no identifier at all). Printed as one markdown table of counts per (policy, ratio).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

from kvsieve.harness.store import ResultsStore
from kvsieve.tasks.load import read_samples

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
KINDS = ("right", "another of the context", "not in the context", "none")


def answer_kind(prediction: str, answer: str, context: str, pattern: re.Pattern) -> str:
    """Which of KINDS a prediction is, for a request whose reference answer is ``answer``."""
    found = pattern.findall(prediction)
    if not found:
        return "none"
    if found[0] == answer:
        return "right"
    return "another of the context" if found[0] in context else "not in the context"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--data", required=True, help="the JSONL the store's rows ran on (for the contexts)")
    parser.add_argument("--task", required=True, help="a task whose reference answers match --pattern")
    parser.add_argument("--pattern", default=UUID, help="the identifiers' regular expression (default: a uuid)")
    args = parser.parse_args()
    pattern = re.compile(args.pattern)
    contexts = {(s.length, s.id): s.context for s in read_samples(args.data) if args.task in s.task}
    if not contexts:
        raise SystemExit(f"{args.data} holds no sample of a task named like {args.task!r}")
    with ResultsStore(args.store) as store:
        rows = [r for r in store.rows() if args.task in r.key.task]
    full_right = {(r.key.length, r.key.sample_id) for r in rows if r.key.policy == "full" and r.score == 100.0}
    counts: dict[tuple[str, float], Counter] = defaultdict(Counter)
    shared: dict[tuple[str, float], list[str]] = defaultdict(list)
    for r in rows:
        request = (r.key.length, r.key.sample_id)
        if r.key.policy == "full" or request not in full_right:
            continue
        kind = answer_kind(r.prediction, r.answers[0], contexts[request], pattern)
        counts[(r.key.policy, r.key.ratio)][kind] += 1
        if kind == "not in the context":
            said = pattern.findall(r.prediction)[0]
            same = sum(a == b for a, b in zip(said, r.answers[0]))
            shared[(r.key.policy, r.key.ratio)].append(f"{same}/{len(r.answers[0])}")
    distinct = [len(set(pattern.findall(context))) for context in contexts.values()]
    print(f"{args.task}: {len(full_right)} requests the full cache answers right (of "
          f"{len({(r.key.length, r.key.sample_id) for r in rows if r.key.policy == 'full'})}); "
          f"{min(distinct)}-{max(distinct)} distinct identifiers a context\n")
    print("| policy | kept | " + " | ".join(KINDS) + " | characters shared (not in the context) |")
    print("|---|---:|" + "---:|" * len(KINDS) + "---|")
    for (policy, ratio), counter in sorted(counts.items()):
        same = ", ".join(shared[(policy, ratio)])
        print(f"| {policy} | {1 - ratio:.1%} | " + " | ".join(str(counter[k]) for k in KINDS) + f" | {same} |")


if __name__ == "__main__":
    main()
