"""Workloads for the simulator: built-in generators and JSONL traces.

A workload is a time-ordered list of :class:`Request`. A prompt is a sequence of *segments*
``(segment id, tokens)``: two prompts share a KV prefix exactly as far as their segment sequences agree
(the simulator chains a hash over fixed-size token units, like vLLM's block hashes). A request's output
is one more segment (``output_segment``) that a later turn of the same conversation can include in its
prompt, so multi-turn history is reused the way vLLM caches generated tokens.

Built-ins (all deterministic for a seed):

* :func:`build_rag_chat` — the design's RAG chat scenario: 1.5K-token system prompt per tenant, 8K tokens of
  retrieved context per session, 200-token user turns, 6 turns, a closed loop of concurrent sessions per
  tenant with idle gaps between turns.
* :func:`build_multi_round_qa` — vLLM production-stack's multi-round QA benchmark
  (``benchmarks/multi-round-qa``): users x rounds, one shared system prompt, a per-user history prompt,
  and the conversation (questions and answers) growing every round; requests at a fixed QPS.
* :func:`build_noisy_neighbour` — one tenant floods unique prompts while the others repeat theirs.

JSONL traces (:func:`read_jsonl_trace`), one request per line::

    {"time": 12.5, "tenant": "acme", "session": "c-17",
     "segments": [["sys-acme", 1536], ["doc-42", 8192], ["q-17-1", 200]],
     "output_tokens": 250, "output_segment": "a-17-1"}

``time`` is seconds from the trace's start; ``session`` (optional, default the tenant) routes the request
to a replica under session routing; ``duration`` (optional) is the seconds the request held its replica
(arrival to last token, from a measured run; default: the simulator's estimate); segment ids are
strings or integers; ``output_segment`` (optional) names the output so a later prompt can include
``[output_segment, output_tokens]``. Instead of ``segments`` a line may carry
``"blocks": [h1, h2, ...]``: block hashes, each standing for one full unit of ``--unit-tokens`` tokens.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Request",
    "TenantLoad",
    "build_multi_round_qa",
    "build_noisy_neighbour",
    "build_rag_chat",
    "read_jsonl_trace",
    "segment_id",
    "write_jsonl_trace",
]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload."""

    time: float
    tenant: str
    session: str
    segments: tuple[tuple[int, int], ...]
    output_tokens: int
    output_segment: int
    #: Seconds from arrival to the last output token when the trace knows it (a replay of a measured
    #: run); ``None``: the simulator estimates it (TTFT + output tokens / decode rate).
    duration: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _, n in self.segments)


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """How much of a built-in workload one tenant sends."""

    name: str
    #: Concurrent sessions (RAG chat), users (multi-round QA) or repeated prompts (noisy neighbour).
    sessions: int
    #: Mean idle gap between turns of one session, seconds (RAG chat).
    think_seconds: float = 60.0


def segment_id(name: str | int) -> int:
    """A stable 63-bit id for a segment name (Python's ``hash`` of str is salted per process)."""
    if isinstance(name, int):
        return name
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") >> 1


@dataclass
class _Ids:
    """Unique segment ids for generated content."""

    next_id: int = 1 << 40
    named: dict[str, int] = field(default_factory=dict)

    def fresh(self) -> int:
        self.next_id += 1
        return self.next_id

    def shared(self, name: str) -> int:
        if name not in self.named:
            self.named[name] = self.fresh()
        return self.named[name]


def _sorted(requests: Iterable[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: (r.time, r.tenant, r.session))


def build_rag_chat(
    tenants: Sequence[TenantLoad],
    duration_seconds: float,
    seed: int = 0,
    system_tokens: int = 1536,
    context_tokens: int = 8192,
    turn_tokens: int = 200,
    output_tokens: int = 250,
    turns: int = 6,
    min_gap_seconds: float = 10.0,
) -> list[Request]:
    """RAG chat sessions in a closed loop: each tenant keeps ``sessions`` conversations going.

    Turn 1 of a session is ``system + retrieved context + user turn``; turn k adds the previous answer
    and a new user turn. Between turns a session idles ``min_gap_seconds`` plus an exponential gap of mean
    ``think_seconds``; a finished session is replaced by a new one after such a gap. Sessions start
    staggered over one session lifetime so the load is steady from the start.
    """
    rng = random.Random(seed)  # noqa: S311 - reproducible workloads, not security
    ids = _Ids()
    out: list[Request] = []
    for load in tenants:
        system = ids.shared(f"system/{load.name}")
        lifetime = turns * (min_gap_seconds + load.think_seconds)
        for slot in range(load.sessions):
            t = rng.uniform(0.0, lifetime)
            serial = 0
            while t < duration_seconds:
                session = f"{load.name}/{slot}/{serial}"
                serial += 1
                prompt: list[tuple[int, int]] = [(system, system_tokens), (ids.fresh(), context_tokens)]
                for _turn in range(turns):
                    if t >= duration_seconds:
                        break
                    prompt.append((ids.fresh(), turn_tokens))
                    answer = ids.fresh()
                    out.append(Request(t, load.name, session, tuple(prompt), output_tokens, answer))
                    prompt.append((answer, output_tokens))
                    t += min_gap_seconds + rng.expovariate(1.0 / load.think_seconds)
    return _sorted(out)


def build_multi_round_qa(
    tenants: Sequence[TenantLoad],
    rounds: int,
    qps: float,
    seed: int = 0,
    system_tokens: int = 1000,
    history_tokens: int = 2000,
    question_tokens: int = 100,
    answer_tokens: int = 100,
) -> list[Request]:
    """vLLM production-stack's multi-round QA: ``sessions`` users per tenant, ``rounds`` rounds each.

    Every prompt is ``shared system prompt + the user's own history prompt + all earlier questions and
    answers + a new question``. Requests are issued in rounds, users in a random order within a round,
    at ``qps`` requests per second overall (the benchmark's ``--qps``).
    """
    rng = random.Random(seed)  # noqa: S311 - reproducible workloads, not security
    ids = _Ids()
    system = ids.shared("system")
    users: list[tuple[str, str, list[tuple[int, int]]]] = []
    for load in tenants:
        for u in range(load.sessions):
            users.append(
                (load.name, f"{load.name}/{u}", [(system, system_tokens), (ids.fresh(), history_tokens)])
            )
    out: list[Request] = []
    t = 0.0
    for _round in range(rounds):
        order = list(range(len(users)))
        rng.shuffle(order)
        for index in order:
            tenant, session, prompt = users[index]
            prompt.append((ids.fresh(), question_tokens))
            answer = ids.fresh()
            out.append(Request(t, tenant, session, tuple(prompt), answer_tokens, answer))
            prompt.append((answer, answer_tokens))
            t += rng.expovariate(qps)
    return _sorted(out)


def build_noisy_neighbour(
    quiet: Sequence[TenantLoad],
    noisy: str,
    duration_seconds: float,
    quiet_interval_seconds: float = 5.0,
    noisy_qps: float = 5.0,
    prompt_tokens: int = 4096,
    output_tokens: int = 64,
    seed: int = 0,
) -> list[Request]:
    """Quiet tenants cycle through their ``sessions`` fixed prompts (one every ``quiet_interval_seconds``
    per tenant); the ``noisy`` tenant sends ``noisy_qps`` requests per second, every prompt unique."""
    rng = random.Random(seed)  # noqa: S311 - reproducible workloads, not security
    ids = _Ids()
    out: list[Request] = []
    for load in quiet:
        prompts = [ids.shared(f"{load.name}/{i}") for i in range(load.sessions)]
        t = rng.uniform(0.0, quiet_interval_seconds)
        i = 0
        while t < duration_seconds:
            segs = ((prompts[i % len(prompts)], prompt_tokens),)
            out.append(
                Request(t, load.name, f"{load.name}/{i % len(prompts)}", segs, output_tokens, ids.fresh())
            )
            i += 1
            t += quiet_interval_seconds
    t = 0.0
    n = 0
    while t < duration_seconds:
        out.append(
            Request(t, noisy, f"{noisy}/{n}", ((ids.fresh(), prompt_tokens),), output_tokens, ids.fresh())
        )
        n += 1
        t += rng.expovariate(noisy_qps)
    return _sorted(out)


def read_jsonl_trace(path: Path, unit_tokens: int) -> list[Request]:
    """Read a JSONL trace (format in the module docstring); ``ValueError`` naming the line on bad input."""
    out: list[Request] = []
    ids = _Ids()
    with path.open() as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                if "blocks" in raw:
                    segments = tuple((segment_id(b), unit_tokens) for b in raw["blocks"])
                else:
                    segments = tuple((segment_id(s), int(n)) for s, n in raw["segments"])
                if any(n <= 0 for _, n in segments):
                    raise ValueError("segment lengths must be positive")
                output_segment = raw.get("output_segment")
                out.append(
                    Request(
                        time=float(raw["time"]),
                        tenant=str(raw["tenant"]),
                        session=str(raw.get("session", raw["tenant"])),
                        segments=segments,
                        output_tokens=int(raw.get("output_tokens", 0)),
                        output_segment=ids.fresh() if output_segment is None else segment_id(output_segment),
                        duration=None if raw.get("duration") is None else float(raw["duration"]),
                    )
                )
            except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
                raise ValueError(f"{path}:{lineno}: bad trace line: {exc}") from None
    return _sorted(out)


def write_jsonl_trace(requests: Iterable[Request], path: Path) -> None:
    """Write requests in the trace format (segment ids as integers)."""
    with path.open("w") as handle:
        for r in requests:
            line: dict[str, object] = {
                "time": r.time,
                "tenant": r.tenant,
                "session": r.session,
                "segments": [list(s) for s in r.segments],
                "output_tokens": r.output_tokens,
                "output_segment": r.output_segment,
            }
            if r.duration is not None:
                line["duration"] = r.duration
            handle.write(json.dumps(line) + "\n")
