"""The one packaging setting pyproject.toml cannot express: ship ``infra/`` (the price catalog, worker
profiles, SkyPilot task files, IAM templates) inside the package as ``echo2._infra``, while the folder
stays at the repository's root. pyproject's ``packages`` is either found (``packages.find``) or listed,
not both, so the list is built here: every package under echo2/ (found, so a new one needs no
entry), plus infra/ mapped onto ``echo2._infra``. Everything else is in pyproject.toml; its
``package-data`` says which of infra/'s files travel (echo2.shipped reads them)."""

from setuptools import find_namespace_packages, setup

INFRA = ["echo2._infra", *(f"echo2._infra.{name}" for name in find_namespace_packages("infra"))]
"""infra/ and its folders: each folder is a package to setuptools (it warns of data folders left unlisted)."""

setup(packages=[*find_namespace_packages(include=["echo2", "echo2.*"]), *INFRA],
      package_dir={"echo2._infra": "infra"})
