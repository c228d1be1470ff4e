"""The validation report as people read it: a table, the pass/fail verdict, JSON, and a
progress bar while the runs go."""

from __future__ import annotations

import json
import sys

from unimem.validate.config import PACKAGE_PROMPTS

__all__ = ["ProgressBar", "format_table", "passed", "write_json"]


def _leak(summary: dict) -> str:
    """``bytes/rows`` still held after a run (``0/0``: nothing leaked)."""
    return f"{summary.get('leaked_bytes', 0)}/{summary.get('leaked_rows', 0)}"


def format_table(report: dict) -> str:
    s, u = report["static"], report["unified"]
    rows = [
        ("", "static", "unified"),
        ("output tokens", s["output_tokens"], u["output_tokens"]),
        ("throughput tok/s", f"{s['throughput_tok_s']:.1f}", f"{u['throughput_tok_s']:.1f}"),
        ("peak bytes", s["peak_bytes"], u["peak_bytes"]),
        ("capacity bytes", s["capacity_bytes"], u["capacity_bytes"]),
        ("steps", s["steps"], u["steps"]),
        ("wall ms/step", f"{s['ms_per_step']:.3f}", f"{u['ms_per_step']:.3f}"),
        ("compactions", "-", u["compactions"]),
        ("retractions", "-", u["retractions"]),
        ("leaked bytes/rows", _leak(s), _leak(u)),
    ]
    if "verify_steps" in s:
        rows += [
            ("verify steps", s["verify_steps"], u["verify_steps"]),
            ("accept length", f"{s['accept_length']:.3f}", f"{u['accept_length']:.3f}"),
            (
                "mean verify length",
                f"{s['mean_verify_length']:.3f}",
                f"{u['mean_verify_length']:.3f}",
            ),
            (
                "verified tokens/step",
                f"{s['tokens_verified_per_step']:.2f}",
                f"{u['tokens_verified_per_step']:.2f}",
            ),
            (
                "lanes per verify batch",
                f"{s['lanes_per_verify_batch']:.2f}",
                f"{u['lanes_per_verify_batch']:.2f}",
            ),
        ]
    if "prefix_cache" in s:
        cs, cu = s["prefix_cache"], u["prefix_cache"]
        rows += [
            ("cache hit rate", f"{cs['hit_rate']:.3f}", f"{cu['hit_rate']:.3f}"),
            ("cache hit tokens", cs["hit_tokens"], cu["hit_tokens"]),
            ("cache evictions", cs["evictions"], cu["evictions"]),
            ("checkpoints saved", cs["checkpoints_saved"], cu["checkpoints_saved"]),
        ]
    w = [max(len(str(r[i])) for r in rows) for i in range(3)]
    lines = [f"{str(a):<{w[0]}}  {str(b):>{w[1]}}  {str(c):>{w[2]}}" for a, b, c in rows]
    n = report["requests"]
    cfg = report.get("config", {})
    if cfg.get("model_path"):
        prompts = cfg.get("prompts_file")
        if prompts == PACKAGE_PROMPTS:
            prompts = "the package's real prompts"
        source = f"prompts: {prompts}" if prompts else "random prompt token ids"
        lines.append(f"model: {cfg['model_path']} ({source})")
    elif cfg.get("preset"):
        lines.append(f"model: synthetic preset {cfg['preset']} (random weights and prompts)")
    if report.get("deterministic_inference"):
        lines.append(
            "deterministic inference: on (batch-invariant GEMMs, norms, experts and GDN tiles; "
            "the default with --device cuda, --disable-deterministic-inference turns it off)"
        )
    lines.append(f"exact match: {report['exact_match']}/{n} requests")
    if "acceptance_control" in report:
        ctl = report["acceptance_control"]
        lines.append(f"drafter: {report['drafter']}")
        if ctl["on"]:
            lines.append(
                f"ACCEPTANCE CONTROL ON (rate {ctl['rate']:g}): drafts are replaced by the "
                "reference continuation at that rate, so accept lengths and speed-ups are the "
                "control's, not the drafter's (--accept-rate 0 measures the drafter)"
            )
        else:
            lines.append("acceptance control: off (accept lengths are the drafter's own)")
    if "control_expected_accept_length" in report:
        draws = report.get("control_draws_accept_length")
        of_draws = f", its draws for this seed {draws:.3f}" if draws is not None else ""
        lines.append(
            "acceptance control: expected accept length "
            f"{report['control_expected_accept_length']:.3f}{of_draws} (measured: static "
            f"{s['accept_length']:.3f}, unified {u['accept_length']:.3f})"
        )
    if "cache_off_matches" in report:
        off = report["cache_off"]
        lines.append(
            f"cache on == cache off: {report['cache_off_matches']}/{n} requests "
            f"(cache-off run: {off['steps']} steps, {off['throughput_tok_s']:.1f} tok/s)"
        )
    if "verify_counts_match" in report:
        ref = report["reference"]
        lines.append(f"verify counts match: {report['verify_counts_match']}/{n} requests")
        lines.append(f"accept lengths match: {report['accept_lengths_match']}/{n} requests")
        matched = report["spec_matches_reference"]
        lines.append(
            f"speculative == non-speculative: "
            f"{'not applicable (sampling)' if matched is None else f'{matched}/{n} requests'} "
            f"(reference run: {ref['steps']} steps, {ref['throughput_tok_s']:.1f} tok/s)"
        )
        if "control_run" in report:
            ctl = report["control_run"]
            lines.append(
                f"acceptance control follows a speculative run without replacement "
                f"({ctl['steps']} steps, accept length {ctl['accept_length']:.3f})"
            )
        for d in report["spec_mismatches"]:
            m = d["logit_margin"]
            margin = "not computed" if m is None else f"{m:.3g}"
            tie = ", a near-tie" if d["near_tie"] else ""
            lines.append(
                f"  {d['mode']} rid {d['rid']}: first differs at output {d['first_diff']} "
                f"(spec {d['spec_token']}, reference {d['reference_token']}, oracle top-2 "
                f"{d['oracle_top2']}, logit margin {margin}{tie})"
            )
    if "oracle_matches" in report:
        lines.append(
            f"equal to transformers: {report['oracle_matches']}/{n} requests "
            f"(largest logprob difference {report['oracle_max_logprob_diff']:.3g})"
        )
    if "throughput_ratio" in report:
        lines.append(f"throughput unified / static: {report['throughput_ratio']:.3f}")
    if report.get("gpu"):
        lines.append(f"gpu: {report['gpu']}")
    return "\n".join(lines)


def passed(report: dict, spec_vs_reference: bool = True) -> bool:
    """Whether every request matched and no run leaked memory (``leaked_bytes`` /
    ``leaked_rows`` 0): static vs unified output (and, with speculation, verify
    counts and accept lengths; with the prefix cache, the cache-off output) and — with
    ``spec_vs_reference`` — the speculative output equals the non-speculative one wherever
    no near-tie explains a flip."""
    n = report["requests"]
    keys = (
        "exact_match",
        "verify_counts_match",
        "accept_lengths_match",
        "cache_off_matches",
        "oracle_matches",
    )
    ok = all(report[k] == n for k in keys if k in report)
    for run in ("reference", "static", "unified", "cache_off", "control_run"):
        summary = report.get(run)
        if isinstance(summary, dict) and (
            summary.get("leaked_bytes", 0) or summary.get("leaked_rows", 0)
        ):
            ok = False  # memory still held after every request finished
    if spec_vs_reference and "spec_mismatches" in report:
        ok = ok and all(d["near_tie"] for d in report["spec_mismatches"])
    return ok


def write_json(report: dict, path: str) -> None:
    text = json.dumps(report, indent=2)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


class ProgressBar:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.enabled = label, max(total, 1), sys.stderr.isatty()

    def update(self, done: int) -> None:
        if self.enabled:
            filled = int(30 * done / self.total)
            bar = "#" * filled + "." * (30 - filled)
            sys.stderr.write(f"\r{self.label} [{bar}] {done}/{self.total} tokens")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
