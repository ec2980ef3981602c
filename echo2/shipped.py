"""The files echo2 ships beside its code: the repository's ``infra/`` folder (the price catalog, the worker
profiles, the SkyPilot task files, the IAM templates), found the same way in a checkout, an editable
install and an installed wheel.

``infra/`` stays where it is in the repository; ``setup.py`` installs it as the package ``echo2._infra``
(a wheel holds it at ``echo2/_infra/``, an editable install maps the name onto the checkout's folder), and
``importlib.resources`` finds that package wherever the import system does. A path relative to this file
(``parents[2] / "infra"``) would point into site-packages' parent once installed from a wheel.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

PACKAGE = "echo2._infra"


def path(*parts: str) -> Path:
    """The shipped file or folder ``infra/<parts...>`` on disk (it need not exist: callers say what is
    missing). Callers read files beside each other (a catalog's README), so a real path, not a stream."""
    resource = files(PACKAGE).joinpath(*parts)
    if not isinstance(resource, Path):  # a zip import, say: pip never installs echo2 that way
        raise RuntimeError(f"echo2's shipped files are not on disk ({resource!r}): install echo2 with pip")
    return resource
