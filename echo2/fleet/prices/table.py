"""``echo2 prices``'s table: a price source's offers as a rich table (``plan_table.py`` is ``echo2 plan``'s)."""

from __future__ import annotations

from echo2.fleet.prices.catalog import Offer


def print_offers(offers: list[Offer], info: dict, spot: bool | None, limit: int = 0, console=None) -> None:
    """``echo2 prices``: a rich table of ``offers`` (as sorted), titled with the source and its date."""
    from rich.console import Console
    from rich.table import Table

    market = "" if spot is None else " (spot)" if spot else " (on-demand)"
    table = Table(title=f"{len(offers)} GPU offers{market}, cheapest first -- {info['source']}"
                        f"{' ' + info['date'] if info.get('date') else ''}: {info['detail']}")
    for col in ("provider", "instance", "GPU x count", "region", "spot $/h", "on-demand $/h", "spot discount"):
        table.add_column(col, justify="right" if "$" in col or "discount" in col else "left")
    for o in offers[:limit or None]:
        s, d = o.spot_usd_per_hour, o.on_demand_usd_per_hour
        table.add_row(o.provider, o.instance_type, f"{o.gpu} x{o.gpu_count}", o.region,
                      "-" if s is None else f"{s:.4f}", "-" if d is None else f"{d:.4f}",
                      f"{1 - s / d:.0%}" if s is not None and d else "-")
    if console is None:
        console = Console()
        console = console if console.is_terminal else Console(width=150)  # a pipe gets whole names, not 80 columns
    console.print(table)
    if limit and len(offers) > limit:
        console.print(f"... {len(offers) - limit} more (--limit 0 shows all)")
