"""Cases per operation and answers by status, from the VCR cassette of scripts/fuzz_serve.sh.

.venv/bin/python scripts/fuzz_counts.py runs/fuzz/vcr-*.yaml
"""

import re
import sys
from collections import Counter, defaultdict
from urllib.parse import urlsplit

import yaml

AD_PATH = re.compile(r"^/v1/ads/[^/]+$")


def operation(request: dict) -> str:
    path = urlsplit(request["uri"]).path
    return f"{request['method']} {'/v1/ads/{ad_id}' if AD_PATH.match(path) else path}"


def main(path: str) -> None:
    with open(path) as f:
        cases = [c for c in yaml.safe_load(f)["http_interactions"] if c.get("response")]
    fuzzed = {operation(c["request"]) for c in cases if c["phase"]["name"] == "fuzzing"}
    rows: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for c in cases:
        # Methods the schema does not have, probed by the coverage phase, share one row.
        op = operation(c["request"])
        op = op if op in fuzzed else "other methods (405 probes)"
        row = rows[op]
        row["status"][int(c["response"]["status"]["code"])] += 1
        row["failed"][c["status"] == "FAILURE"] += 1
        if c["phase"]["name"] == "fuzzing":
            row["fuzzing"][c["generation"]["mode"]] += 1
    print("| operation | fuzzing cases (positive + negative) | all cases | failed | answers |")
    print("| --- | ---: | ---: | ---: | --- |")
    for op in [*sorted(fuzzed), "other methods (405 probes)"]:
        row = rows[op]
        fuzz = row["fuzzing"]
        answers = ", ".join(f"{code}: {n}" for code, n in sorted(row["status"].items()))
        print(
            f"| `{op}` | {fuzz.total()} ({fuzz['positive']} + {fuzz['negative']}) "
            f"| {row['status'].total()} | {row['failed'][True]} | {answers} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
