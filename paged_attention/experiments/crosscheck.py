"""The real vLLM as the oracle: the same cases on both engines, compared field by field.

:func:`run_probe` runs :mod:`.peer_probe` in a given Python (this package's, or the virtual
environment that holds vLLM's CPU build: ``make crosscheck`` makes it), and :func:`compare` checks
the two answers:

* token ids, texts, finish and stop reasons, prompts, prompt ids, ``num_cached_tokens``: equal;
* log-probabilities (of outputs, of prompts, ``cumulative_logprob``): within :data:`LOGPROB_TOL`,
  the same tokens in the same order (two tokens closer than the tolerance may swap places);
  ``cumulative_logprob`` is ``None`` on both or a number on both;
* ``repr(SamplingParams(...))`` and its defaults: equal;
* the attributes of ``RequestOutput``/``CompletionOutput``: vLLM's that are missing here must be
  listed in :data:`~..engine.compatibility.MISSING_FIELDS`, with the reason.

Each case gives a :class:`Check` (``ok``, what differed); a difference in anything but a listed
field fails the cross-check.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.compatibility import MISSING_FIELDS

LOGPROB_TOL = 1e-4  # float32 kernels of two engines: observed differences are ~2e-5


PROBE = Path(__file__).with_name("peer_probe.py")


@dataclass
class Check:
    """One case compared: ``ok`` when nothing differs; ``notes`` say what did."""

    name: str
    ok: bool = True
    notes: list[str] = field(default_factory=list)
    requests: int = 0
    tokens: int = 0

    def fail(self, note: str) -> None:
        self.ok = False
        if len(self.notes) < 5:
            self.notes.append(note)


def run_probe(python: str, engine: str, cases: Path, out: Path, env: dict[str, str] | None = None,
              timeout: float = 900) -> dict[str, Any]:  # fmt: skip
    """Run the probe with ``python`` for ``engine``; returns its answers (raises with its log)."""
    done = subprocess.run(
        [python, str(PROBE), "--engine", engine, str(cases), str(out)],
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=out.parent,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {engine} probe failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def close(a: float | None, b: float | None) -> bool:
    """Both ``None``, or two log-probabilities within :data:`LOGPROB_TOL`."""
    return (a is None) == (b is None) and (a is None or b is None or abs(a - b) <= LOGPROB_TOL)


def compare_logprobs(check: Check, where: str, ours: Any, theirs: Any) -> None:
    """Two lists of positions, each ``None`` or ``[(token_id, logprob, rank, text), ...]`` with the
    chosen (or prompt) token first: the same tokens, ranks and texts, logprobs within the tolerance
    (the last of a top-k may swap with a near tie)."""
    if (ours is None) != (theirs is None):
        check.fail(f"{where}: logprobs {'missing' if ours is None else 'unexpected'} here")
        return
    if ours is None:
        return
    if len(ours) != len(theirs):
        check.fail(f"{where}: {len(ours)} logprob positions, vLLM {len(theirs)}")
        return
    for position, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if (a is None) != (b is None):
            check.fail(f"{where} position {position}: entry None on one side only")
            continue
        if a is None:
            continue
        ids_a, ids_b = [e[0] for e in a], [e[0] for e in b]
        values_b = {e[0]: e for e in b}
        if ids_a[0] != ids_b[0] or set(ids_a) != set(ids_b):
            # The k-th and (k+1)-th most likely tokens may swap when closer than the tolerance: the
            # edge is the least of vLLM's top-k (its entries after the sampled token's, if any).
            edge = min(e[1] for e in (b[1:] or b))
            strays = set(ids_a) ^ set(ids_b)
            near = all(abs(e[1] - edge) <= LOGPROB_TOL for e in [*a, *b] if e[0] in strays)
            if ids_a[0] != ids_b[0] or not near:
                check.fail(f"{where} position {position}: tokens {ids_a} here, {ids_b} in vLLM")
                continue
        for token_id, logprob, rank, text in a:
            if token_id not in values_b:
                continue
            _, their_logprob, their_rank, their_text = values_b[token_id]
            if abs(logprob - their_logprob) > LOGPROB_TOL:
                check.fail(f"{where} position {position}: token {token_id} logprob {logprob:.6f}, "
                           f"vLLM {their_logprob:.6f}")  # fmt: skip
            if rank != their_rank and not any(
                abs(e[1] - logprob) <= LOGPROB_TOL for e in b if e[0] != token_id
            ):
                check.fail(f"{where} position {position}: token {token_id} rank {rank}, vLLM {their_rank}")
            if text != their_text:
                check.fail(
                    f"{where} position {position}: token {token_id} text {text!r}, vLLM {their_text!r}"
                )


def _compare_outputs(check: Check, ours: list[dict], theirs: list[dict]) -> None:
    if len(ours) != len(theirs):
        check.fail(f"{len(ours)} outputs, vLLM {len(theirs)}")
        return
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        check.requests += 1
        for key in ("prompt", "prompt_token_ids", "finished", "num_cached_tokens"):
            if a[key] != b[key]:
                check.fail(f"request {i}: {key} {str(a[key])[:60]!r} here, vLLM {str(b[key])[:60]!r}")
        compare_logprobs(check, f"request {i} prompt", a["prompt_logprobs"], b["prompt_logprobs"])
        _compare_fields(check, "RequestOutput", a["fields"], b["fields"])
        if len(a["outputs"]) != len(b["outputs"]):
            check.fail(f"request {i}: {len(a['outputs'])} samples, vLLM {len(b['outputs'])}")
            continue
        for j, (x, y) in enumerate(zip(a["outputs"], b["outputs"], strict=True)):
            check.tokens += len(y["token_ids"])
            where = f"request {i} sample {j}"
            for key in ("index", "token_ids", "text", "finish_reason", "stop_reason"):
                if x[key] != y[key]:
                    check.fail(f"{where}: {key} {str(x[key])[:80]} here, vLLM {str(y[key])[:80]}")
            if not close(x["cumulative_logprob"], y["cumulative_logprob"]):
                check.fail(
                    f"{where}: cumulative_logprob {x['cumulative_logprob']}, vLLM {y['cumulative_logprob']}"
                )
            compare_logprobs(check, where, x["logprobs"], y["logprobs"])
            _compare_fields(check, "CompletionOutput", x["fields"], y["fields"])


def _compare_fields(check: Check, kind: str, ours: list[str], theirs: list[str]) -> None:
    missing = [name for name in theirs if name not in ours and name not in MISSING_FIELDS]
    if missing and not any(note.startswith(kind) for note in check.notes):
        check.fail(f"{kind} lacks vLLM's {missing} (and MISSING_FIELDS gives no reason)")


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> list[Check]:
    """One :class:`Check` per case, in the order of vLLM's answers."""
    checks = []
    for name, expected in theirs["answers"].items():
        check = Check(name)
        got = ours["answers"].get(name)
        ours_error, their_error = (a.get("error") if isinstance(a, dict) else None for a in (got, expected))
        if got is None:
            check.fail("no answer here")
        elif ours_error or their_error:  # no case is meant to fail: an error on either side is a difference
            check.fail(f"raised {ours_error} here, {their_error} in vLLM")
        elif type(got) is not type(expected):
            check.fail(f"{str(got)[:80]} here, vLLM {str(expected)[:80]}")
        elif isinstance(expected, list) and (not expected or len(got) != len(expected)):
            check.fail(f"{len(got)} answers here, vLLM {len(expected)}")
        elif isinstance(expected, list) and all(isinstance(e, dict) for e in expected):
            _compare_outputs(check, got, expected)
        elif isinstance(expected, list):  # the Gumbel-max draws: one token per row
            check.requests = len(expected)
            for row, (a, b) in enumerate(zip(got, expected, strict=True)):
                if a != b:
                    check.fail(f"row {row}: token {a} here, vLLM's kernel {b}")
        elif got != expected:
            if isinstance(expected, dict):
                for key in sorted(set(expected) | set(got)):
                    if got.get(key) != expected.get(key):
                        check.fail(f"{key}: {got.get(key)} here, vLLM {expected.get(key)}")
            else:
                check.fail(f"{got!r} here, vLLM {expected!r}")
        checks.append(check)
    return checks


def table(checks: list[Check]) -> str:
    """The printed summary: one line per case, then what differed."""
    width = max(len(c.name) for c in checks)
    lines = [f"{'case':<{width}}  result     requests  tokens"]
    for c in checks:
        result = "same" if c.ok else "DIFFERS"
        lines.append(f"{c.name:<{width}}  {result:<9}  {c.requests:>8}  {c.tokens:>6}")
        lines += [f"    {note}" for note in c.notes]
    return "\n".join(lines)
