"""Where something lives: a site is a (provider, region) pair, spelled ``provider/region`` with the provider in
lower case (``aws/us-east-1``), the one spelling relay plans, peers' byte counters and the cost report share.

The store's site comes from ``store.provider`` and ``store.region`` of a run's config: ``StoreConfig.site`` for
a parsed config, ``RunInfo.store_site`` (``run_folder.py``) for the raw config a ``run.json`` carries; both
call ``store_site`` here, so a provider without a region reads the same ("?" for the region) everywhere.
"""

from __future__ import annotations

import re

_SITE_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


def site_part(value: object) -> bool:
    """Whether ``value`` may be a site's provider or region (a name, no slash or space)."""
    return isinstance(value, str) and _SITE_PART.match(value) is not None


def site_name(provider: str, region: str) -> str:
    """How a site is spelled in plans and counters."""
    return f"{provider.lower()}/{region}"


def split_site(site: str) -> tuple[str, str] | None:
    """(provider, region) of a site name; None for the unknown site ""."""
    provider, sep, region = site.partition("/")
    return (provider, region) if sep else None


def store_site(provider: object, region: object) -> tuple[str, str] | None:
    """The store's (provider, region), lower-case provider, from ``store.provider`` and ``store.region``; region
    "?" when only the provider is known; None when the provider is not (values read from ``run.json`` are not
    trusted to be strings, so anything else reads as unknown)."""
    if not isinstance(provider, str) or not provider:
        return None
    return provider.lower(), region if isinstance(region, str) and region else "?"
