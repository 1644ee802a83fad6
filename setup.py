"""elastictk: fault-tolerant, elastic distributed PyTorch training as composable primitives."""
from setuptools import find_packages, setup

setup(
    name="elastictk",
    version="0.3.0",
    description="Fault-tolerant, elastic distributed PyTorch training: stores, rendezvous, "
    "supervisor, watchdog timers, metrics and fault injection",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["elastictk", "elastictk.*"]),  # bench/ runs from a checkout
    install_requires=[
        # torch is deliberately unpinned here: the Makefile installs the exact CPU wheel first,
        # and any installed torch >= 2.4 satisfies this without pip resolving a new one.
        "torch>=2.4",
        "psutil>=5.9",
        "prometheus-client>=0.17",
        # process titles: workers forked from the preload server read as the command line
        # torchrun would run (ps, top, pgrep -f); the standard Ray, gunicorn and Celery use
        "setproctitle>=1.3",
        # the progress watchdog's stacks of a stopped (SIGSTOP) or unresponsive worker:
        # py-spy reads a Python process's stacks from outside, the standard tool for it
        "py-spy>=0.3.14",
        # snapshot checksums: XXH3-64 reads memory ~4x faster than zlib's CRC-32, so verifying
        # a part before a restore costs little; xxhash is the standard binding (datasets, HF)
        "xxhash>=3.0",
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6.80", "pytest-timeout>=2.1",
                 # two test processes: most tests wait on real processes, heartbeats and
                 # timeouts, so two at once on 2 cores take 9 minutes instead of 15
                 "pytest-xdist>=3.5",
                 # the checks make test runs: lint, types, and the layer contract (pyproject.toml)
                 "ruff>=0.6", "mypy>=1.10", "import-linter>=2.0"],
        # the docs site (make docs; make check builds it with --strict): MkDocs with the Material
        # theme, the standard for Python projects' docs, and mkdocstrings for the API reference
        # from the docstrings
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
        # elastictk-chaos draws chaos-timeline.png with it; without it the picture is skipped
        "plots": ["matplotlib>=3.8"],
    },
    entry_points={"console_scripts": [
        "elastictk-run = elastictk.run:console_main",
        "elastictk-chaos = elastictk.chaos.cli:console_main",
    ]},
)
