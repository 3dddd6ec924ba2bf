"""`mrp demo`'s report as text: the latency and throughput tables, their legend, two samples.

`demo.py` measures and judges; this module only turns its `DemoReport` into what the CLI
prints (`demo_text`) and the JSON line it ends with on `--json` (`demo_json`). A row's cells
are strings: percentages, speed ratios ("2.10x", "0.80x slower" where the row must beat
its reference), yes/no.

Deliberately not here: measuring or judging rows (`demo.py`), printing (the CLI).
"""

from __future__ import annotations

from mrp_dlm.eval.demo import MARGIN, DemoReport
from mrp_dlm.eval.grid import BASELINE
from mrp_dlm.model.invariant import UP_TO_TIES

DEMO_COLUMNS = ["task", "mode", "setting", "accuracy", "tokens/forward", "query/forward",
                "tokens/s", "vs static", "must equal", "vs rule", "vs frontier",
                "vs self-drafts", "drafts", "same", "lossless", "recommended"]
THROUGHPUT_COLUMNS = ["task", "mode", "setting", "accuracy", "tokens/s", "vs static",
                      "vs rule", "vs frontier", "recommended"]
SAMPLES_SHOWN = 2  # completions printed after the tables, spread over the results


def format_table(rows: list[dict], columns: list[str]) -> str:
    """Left-aligned columns, two spaces apart, under a header line."""
    cells = [[str(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def times(value: float | None, slower: bool = True) -> str:
    """A speed ratio as the demo prints it; 'slower' below 1 where the row must beat it."""
    if value is None:
        return "-"
    return f"{value:.2f}x" + (" slower" if slower and value < 1 else "")


def demo_cells(row: dict) -> dict:
    """A demo row as the table shows it: percentages, ratios, yes/no."""
    lossless = "reference" if row["mode"] == BASELINE else (
        ("yes*" if row.get("exactness") == UP_TO_TIES else "yes") if row["lossless"]
        else "no")
    rule = row["reproduces"] if row["lossless"] and row["mode"] != BASELINE else None
    frontier = "-" if row["frontier"] is None else \
        f"{times(row['speedup_vs_frontier'])} ({row['frontier']})"
    share = row.get("self_draft_share")
    mode = row["family"] if row["mode"] == "speculative" else row["mode"]  # speculative-self
    return {"task": row["task"], "mode": mode, "setting": row["setting"] or "-",
            "accuracy": f"{row['accuracy']:.0%}",
            "tokens/forward": f"{row['tokens_per_forward']:.2f}",
            "query/forward": f"{row.get('query_tokens_per_forward', 0):.0f}",
            "tokens/s": f"{row['tokens_per_second']:.0f}",
            "vs static": times(row["speedup"], slower=False),
            "must equal": rule or "-", "vs rule": times(row["speedup_vs_rule"] if rule else None),
            "vs frontier": frontier, "vs self-drafts": times(row.get("speedup_vs_self")),
            "drafts": "-" if share is None else f"self:{share:.0%}",
            "same": f"{row['n'] - row['differing_from_rule']}/{row['n']}" if rule else "-",
            "lossless": lossless, "recommended": ", ".join(row["recommended"]) or "-"}


def demo_legend(report: DemoReport) -> str:
    batch, timed = report.batch_size, report.latency_problems
    return (f"Latency above: tokens/s at batch 1 (one prompt per decode call, what a chat user "
            f"sees) on the first {timed} problems per task; throughput below: all {batch} "
            f"problems of a task as one batch of {batch}. Each regime decodes every mode "
            f"several times ({report.latency_repeats} at batch 1, "
            f"{report.throughput_repeats} batched), round-robin over the tasks and modes, and "
            f"keeps each decode call's fastest. accuracy and same: over all {batch} problems "
            "per task, from the batched decode; the other columns are each regime's own. "
            "tokens/forward: generated tokens (up to the stop token) per backbone "
            "forward of a row, the prompt's forwards and those that finish the last block past "
            "the stop included (so static, one token per denoising forward, shows less than 1); "
            "query/forward: block tokens the backbone ran per denoising forward of a row (L "
            "for the rule, L x the verify copies in a speculative round). "
            "vs static: tokens/s over static's in the same regime; lossless: output identical "
            "by construction to the rule it must equal (static, or dynamic at the speculative "
            "threshold; yes*: exact up to float ties, the verify copies ran batched, "
            "--invariant-verify off, rates in docs/results.md); vs rule: its tokens/s over "
            "that rule's, the speed it must beat ('slower': it does not); vs frontier: a "
            "lossy row that reads the head, over the fastest head-free dynamic row here at "
            "least as accurate (named); vs self-drafts: a head-drafting speculative row over "
            "speculation with self-drafts only at the same threshold; drafts: the share of "
            "its drafts after the first that were self-drafts; same: on how many problems it "
            "was identical to its rule. recommended, per task and regime, each pick walking "
            "its rows in one order and "
            f"moving on only to a row more than {MARGIN:.0%} faster than the pick so far: "
            "exact = the fastest of static, the rules and the lossless rows (in that order, "
            f"so a lossless row is picked only when more than {MARGIN:.0%} faster than its "
            "rule); fastest no-loss = the fastest row as accurate as static, walking those "
            "exact rows first in the same order, then the others (so a lossless row picked "
            "for no-loss is the exact pick too).")


def sample_texts(report: DemoReport) -> list[str]:
    """The first completion of `SAMPLES_SHOWN` results spread over the run, with its verdict."""
    step = max(len(report.results) // SAMPLES_SHOWN, 1)
    texts = []
    for result in report.results[::step][:SAMPLES_SHOWN]:
        sample = result.samples[0]
        texts.append(f"--- {result.task} ({result.config.mode}), "
                     f"{'correct' if sample.correct else 'wrong'}\n{sample.problem}\n"
                     f">>> {sample.completion}")
    return texts


def demo_text(report: DemoReport) -> str:
    """Everything `mrp demo` prints after its decodes: the note on modes left out, both
    tables, the legend and the samples."""
    parts = []
    if report.dropped:
        parts.append(f"note: no MRP head (give --head DIR), so {', '.join(report.dropped)} "
                     "are left out")
    parts.append(f"\nlatency: batch 1, first {report.latency_problems} problems per task")
    parts.append(format_table([demo_cells(row) for row in report.rows], DEMO_COLUMNS))
    parts.append(f"\nthroughput: batch {report.batch_size}, all {report.batch_size} problems "
                 "per task")
    parts.append(format_table([demo_cells(row) for row in report.throughput_rows],
                              THROUGHPUT_COLUMNS))
    parts.append(demo_legend(report))
    parts += ["\n" + text for text in sample_texts(report)]
    return "\n".join(parts)


def demo_json(report: DemoReport) -> dict:
    """The rows of both regimes and how they were measured: `mrp demo --json`'s last line."""
    return {"demo": report.rows, "throughput": report.throughput_rows,
            "batch_size": report.batch_size, "latency_problems": report.latency_problems,
            "latency_repeats": report.latency_repeats,
            "throughput_repeats": report.throughput_repeats}
