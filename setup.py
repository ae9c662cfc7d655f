"""One installed package, ``actstore``: the repository's ``ingest/`` and ``query/`` folders are its
subpackages ``actstore.ingest`` and ``actstore.query`` (setuptools' package-dir mapping; the project's
metadata is in pyproject.toml)."""

from setuptools import find_packages, setup

FOLDERS = {"actstore.ingest": "ingest", "actstore.query": "query"}

packages = find_packages(include=["actstore", "actstore.*"])
for name, folder in FOLDERS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(where=folder)]

setup(packages=packages, package_dir=FOLDERS)
