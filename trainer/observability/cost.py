"""What a run cost: device-hours times the price, per million tokens, and the share lost to failures.

Used by the trainer's end-of-run summary (one process lifetime) and by the launcher, which knows the
whole job's wall time and the time lost to failures and restarts (from its events ledger).
"""

from __future__ import annotations


def cost_report(devices: int, wall_s: float, tokens: int, lost_s: float = 0.0, price: float = 0.0) -> dict:
    """Cost of `devices` devices held for `wall_s` seconds at `price` per device-hour.

    tokens: tokens trained (kept, i.e. not counting work redone after a restart);
    lost_s: the part of wall_s that produced nothing kept (failure detection, restarts, recomputed steps).
    Returns device_hours, cost, cost_per_mtok (cost per million tokens), lost_cost and lost_share.
    With price 0 the costs are 0 and only the device-hours and the lost share are meaningful.
    """
    if devices < 1:
        raise ValueError(f"devices must be >= 1; got {devices}")
    if wall_s < 0 or lost_s < 0 or tokens < 0 or price < 0:
        raise ValueError("wall_s, lost_s, tokens and price must be >= 0")
    lost_s = min(lost_s, wall_s)
    device_hours = devices * wall_s / 3600.0
    cost = device_hours * price
    lost_share = lost_s / wall_s if wall_s > 0 else 0.0
    return {
        "devices": devices,
        "wall_s": wall_s,
        "tokens": tokens,
        "device_hours": device_hours,
        "price_per_device_hour": price,
        "cost": cost,
        "cost_per_mtok": cost / (tokens / 1e6) if tokens else float("nan"),
        "lost_s": lost_s,
        "lost_share": lost_share,
        "lost_cost": cost * lost_share,
    }


def format_cost(report: dict) -> str:
    """One line for a summary: `cost 1.23 (0.45 device-h x 2.70/h) | 0.031 per M tokens | lost 4.1% (0.05)`."""
    line = (f"cost {report['cost']:,.4g} ({report['device_hours']:,.3g} device-h x "
            f"{report['price_per_device_hour']:,.4g}/h) | {report['cost_per_mtok']:,.4g} per M tokens")
    if report["lost_s"]:
        line += f" | lost to failures/restarts {100 * report['lost_share']:.1f}% ({report['lost_cost']:,.4g})"
    return line
