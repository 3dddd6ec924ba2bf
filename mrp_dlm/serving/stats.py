"""Serving stats of the dLLM algorithms on MRP architectures, per algorithm: in the log and
in SGLang's Prometheus metrics (`--enable-metrics`).

Counted where SGLang's scheduler turns a dLLM forward's result into request outputs (the
hook `sglang_process.around_dllm_result`), so the MRP algorithms and LowConfidence, their
baseline, are counted the same way. Under FDFO (the only mode counted) each call is one
forward of every request in the batch:
- forwards: a request's forwards over blocks past its prompt (one per forward, however many
  verify rows it had); a block that is all prompt is counted apart, as a prefill forward;
- tokens: what a finished request returns (after its stop token), as `mrp generate` counts;
- MrpSpeculative adds its drafting rounds: rounds that verified a draft after the first,
  the drafts verified (of which self-drafts) and accepted (`record_round`), and the block
  rows each forward ran, L query tokens a row (`record_rows`).
SGLang's own requests (its warm-up, `/health_generate`) are not counted. The log has one
line per finished request, with the server's totals. With `--enable-metrics` the counters
METRICS (label `algorithm`) join SGLang's on `/metrics` (SGLang collects every process's
prometheus_client values from PROMETHEUS_MULTIPROC_DIR). Ratios are PromQL divisions.

Deliberately not here: decoding (the algorithms only call `record_round`); reading
SGLang's scheduler (`sglang_process.py`).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

COUNTED_ALGORITHMS = ("MrpSpeculative", "MrpDirect", "MrpRemask", "LowConfidence")  # on SDAR models
METRICS = {  # ServingStats counter -> (Prometheus name without _total, help)
    "requests": ("mrp_dlm_requests", "finished requests"),
    "forwards": ("mrp_dlm_forwards", "forwards of finished requests' generation blocks"),
    "prefill_forwards": ("mrp_dlm_prefill_forwards", "forwards of prompt-only blocks"),
    "tokens": ("mrp_dlm_generated_tokens", "tokens returned by finished requests"),
    "draft_rounds": ("mrp_dlm_draft_rounds", "MrpSpeculative rounds verifying drafts"),
    "drafts": ("mrp_dlm_drafts", "MrpSpeculative drafts verified (head and self)"),
    "self_drafts": ("mrp_dlm_self_drafts", "MrpSpeculative self-drafts verified"),
    "accepted": ("mrp_dlm_accepted_drafts", "MrpSpeculative drafts accepted"),
    "query_tokens": ("mrp_dlm_query_tokens", "MrpSpeculative block tokens forwarded, L a row"),
    "row_calls": ("mrp_dlm_request_forwards", "MrpSpeculative requests' forwards"),
}


@dataclass(frozen=True)
class RequestForward:
    """One request's part of one dLLM forward, as the scheduler saw it."""

    rid: str  # SGLang's request id
    generating: bool  # the block reaches past the prompt (else: a prompt-only block)
    finished: bool  # the request finished with this forward
    returned: int  # tokens the request returns (when finished; 0 otherwise)


@dataclass(frozen=True)
class FinishedRequest:
    rid: str  # SGLang's request id
    tokens: int  # tokens it returned
    forwards: int  # forwards of its generation blocks


@dataclass
class ServingStats:
    """Running totals of one algorithm in one server process."""

    algorithm: str  # the dLLM algorithm's name
    requests: int = 0  # finished requests
    forwards: int = 0  # forwards of the finished requests' generation blocks
    prefill_forwards: int = 0  # forwards of prompt-only blocks (all requests)
    tokens: int = 0  # tokens the finished requests returned
    draft_rounds: int = 0  # MrpSpeculative: rounds that verified at least one later draft
    drafts: int = 0  # drafts after the first verified in those rounds (head and self)
    self_drafts: int = 0  # of which self-drafts (the rule on the seed logits)
    accepted: int = 0  # drafts accepted in those rounds
    query_tokens: int = 0  # MrpSpeculative: block tokens forwarded (L per row, all requests)
    row_calls: int = 0  # MrpSpeculative: requests' forwards those tokens were counted over
    open_forwards: dict[str, int] = field(default_factory=dict)  # rid -> forwards so far

    def record(self, rows: list[RequestForward]) -> list[FinishedRequest]:
        """Count one forward's requests; returns the requests it finished."""
        finished = []
        for row in rows:
            forwards = self.open_forwards.get(row.rid, 0) + int(row.generating)
            self.prefill_forwards += int(not row.generating)
            if not row.finished:
                self.open_forwards[row.rid] = forwards
                continue
            self.open_forwards.pop(row.rid, None)
            self.requests += 1
            self.forwards += forwards
            self.tokens += row.returned
            finished.append(FinishedRequest(row.rid, row.returned, forwards))
        return finished

    def record_round(self, drafted: int, accepted: int, self_drafted: int = 0) -> None:
        """One MrpSpeculative verify round of one request: drafts verified, accepted, and
        how many of the verified were self-drafts."""
        if drafted:
            self.draft_rounds += 1
            self.drafts += drafted
            self.self_drafts += self_drafted
            self.accepted += accepted

    def record_rows(self, requests: int, rows: int, block_size: int) -> None:
        """One MrpSpeculative forward of `requests` requests over `rows` block rows."""
        self.row_calls += requests
        self.query_tokens += rows * block_size

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / max(self.forwards, 1)

    @property
    def query_tokens_per_forward(self) -> float:
        """Block tokens the backbone ran per request per forward: L x its rows (its own
        and its drafts' verify rows), averaged."""
        return self.query_tokens / max(self.row_calls, 1)

    @property
    def forwards_per_request(self) -> float:
        return self.forwards / max(self.requests, 1)

    def counters(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in METRICS}

    def summary(self) -> str:
        text = (f"{self.requests} requests, {self.forwards_per_request:.2f} forwards per "
                f"request, {self.tokens_per_forward:.3f} tokens per forward (generated tokens "
                f"only; {self.prefill_forwards} prompt-only forwards apart)")
        if self.row_calls:
            text += f", {self.query_tokens_per_forward:.1f} query tokens per forward"
        if self.draft_rounds:
            text += (f", {self.accepted / self.draft_rounds:.2f} of "
                     f"{self.drafts / self.draft_rounds:.2f} drafts accepted per round "
                     f"({self.draft_rounds} rounds; drafts {self.drafts - self.self_drafts} "
                     f"head, {self.self_drafts} self)")
        return text


STATS: "weakref.WeakKeyDictionary[Any, ServingStats]" = weakref.WeakKeyDictionary()


def stats_of(algorithm: Any) -> ServingStats:
    """The stats of an algorithm object (made on first use, dropped with the object)."""
    if algorithm not in STATS:
        STATS[algorithm] = ServingStats(type(algorithm).__name__)
    return STATS[algorithm]


class MetricSink:
    """The METRICS counters of this process; `export` adds what changed since last time."""

    def __init__(self) -> None:
        from prometheus_client import Counter  # after SGLang set PROMETHEUS_MULTIPROC_DIR

        self.counters = {key: Counter(name, text, ["algorithm"])
                         for key, (name, text) in METRICS.items()}
        self.exported: dict[str, dict[str, int]] = {}  # algorithm -> counter values sent

    def export(self, stats: ServingStats) -> None:
        """Every counter of the algorithm appears (0 until it moves), then grows with it."""
        sent = self.exported.setdefault(stats.algorithm, dict.fromkeys(METRICS, 0))
        for key, value in stats.counters().items():
            counter = self.counters[key].labels(algorithm=stats.algorithm)
            if value > sent[key]:
                counter.inc(value - sent[key])
                sent[key] = value


SINKS: list[MetricSink] = []  # at most one per process, made when metrics are on


def metric_sink() -> MetricSink:
    if not SINKS:
        SINKS.append(MetricSink())
    return SINKS[0]


def count_forward(algorithm: Any, rows: list[RequestForward], metrics: bool) -> None:
    """One forward's requests to the algorithm's stats: a log line per finished request,
    the counters exported when `metrics` (--enable-metrics) is on."""
    stats = stats_of(algorithm)
    for done in stats.record(rows):
        log.info("%s: request %s returned %d tokens in %d forwards; server: %s",
                 stats.algorithm, done.rid, done.tokens, done.forwards, stats.summary())
    if metrics:
        metric_sink().export(stats)
