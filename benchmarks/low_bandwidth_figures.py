"""The figures of ``benchmarks/low_bandwidth.py`` (issue 26): a variant's line from what its peers
counted, a model's summary (the best local SGD variant against sync), the worst over models, and
the issue's bars beside them. Pure functions of the lines, apart from the processes that made them.
"""

from __future__ import annotations

from typing import Any

BARS = {
    "bytes_ratio": (">=", 100.0),
    "loss_gap": ("|x| <=", 0.02),
    "shaped_speedup": (">=", 5.0),
    "down_bits_per_param": ("<=", 4.0),
    "busy_fraction": (">= (aim)", 0.9),
}


def summarize_variant(name: str, model: str, results: list[dict], loss: float, shaped: bool) -> dict[str, Any]:
    """A variant's line from its peers' reports (bytes after the join barrier, the join apart) and
    the final loss; ``down_bits_per_param`` divides each peer's download by the rounds it saw."""
    samples = sum(r["samples"] for r in results)
    elapsed = max(r["ended"] for r in results) - min(r["started"] for r in results)
    rounds = [r["rounds"] for r in results]
    busy = [r["busy_fraction"] for r in results if r["busy_fraction"] is not None]
    per_round = [r["down"] / r["rounds"] for r in results if r["rounds"] > 0]
    num_params = results[0]["num_params"]
    return {
        "variant": name,
        "model": model,
        "num_params": num_params,
        "samples": samples,
        "up_bytes_per_sample": sum(r["up"] for r in results) / samples,
        "down_bytes_per_sample": sum(r["down"] for r in results) / samples,
        "join_down_bytes": sum(r["join_down"] for r in results) / len(results),
        "join_bytes_per_sample": sum(r["join_up"] + r["join_down"] for r in results) / samples,
        "final_loss": loss,
        "samples_per_s": samples / elapsed,
        "shaped": shaped,
        "rounds": max(rounds),
        "late_rounds": sum(r["late_rounds"] for r in results),
        "busy_fraction": sum(busy) / len(busy) if busy else None,
        "down_bits_per_param": sum(per_round) / len(per_round) * 8 / num_params if per_round else None,
    }


def summarize_model(model: str, lines: list[dict], shaped_note: str | None) -> dict[str, Any]:
    """The issue's figures for one model: the best local SGD variant is the one moving the fewest
    bytes per sample (up + down) among those that ran and whose model is no more than the loss bar
    worse than sync's (a lower loss is no reason to pass a variant over); among all that ran when
    none is."""

    def total(v: dict) -> float:
        return v["up_bytes_per_sample"] + v["down_bytes_per_sample"]

    sync = lines[0]
    ran = [v for v in lines[1:] if "refused" not in v]
    good = [v for v in ran if (v["final_loss"] - sync["final_loss"]) / sync["final_loss"] <= BARS["loss_gap"][1]]
    best = min(good or ran, key=total)
    speedup = best["samples_per_s"] / sync["samples_per_s"] if sync["shaped"] else None
    with_join = (total(sync) + sync["join_bytes_per_sample"]) / (total(best) + best["join_bytes_per_sample"])
    return {
        "model": model,
        "sync": sync["variant"],
        "best": best["variant"],
        "variants": [v["variant"] for v in lines],
        "refused": {v["variant"]: v["refused"] for v in lines if "refused" in v},
        "bytes_ratio": total(sync) / total(best),
        "bytes_ratio_with_join": with_join,
        "loss_gap": (best["final_loss"] - sync["final_loss"]) / sync["final_loss"],
        "shaped_speedup": speedup,
        "shaped": shaped_note or "yes",
        "busy_fraction": best["busy_fraction"],
        "down_bits_per_param": best["down_bits_per_param"],
    }


def worst(per_model: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's keys, each the worst over the models (None where a model has none)."""

    def pick(key: str, fn: Any) -> Any:
        values = [m[key] for m in per_model]
        return None if any(v is None for v in values) else fn(values)

    return {
        "bytes_ratio": pick("bytes_ratio", min),
        "loss_gap": pick("loss_gap", lambda v: max(v, key=abs)),
        "shaped_speedup": pick("shaped_speedup", min),
        "busy_fraction": pick("busy_fraction", min),
        "down_bits_per_param": pick("down_bits_per_param", max),
    }


def bars(figures: dict[str, Any]) -> dict[str, str]:
    """Each bar of the issue beside its figure: "met", "not met", or why it is not measured."""
    out = {}
    for key, (op, bar) in BARS.items():
        value = figures[key]
        if value is None:
            out[key] = f"{op} {bar}: not measured"
            continue
        ok = abs(value) <= bar if op.startswith("|x|") else (value <= bar if op == "<=" else value >= bar)
        why = " (local SGD's loss is the lower one)" if key == "loss_gap" and value < -bar else ""
        out[key] = f"{op} {bar}: {'met' if ok else 'not met'}{why}"
    return out
