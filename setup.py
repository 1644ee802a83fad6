"""elastictk: fault-tolerant, elastic distributed PyTorch training as composable primitives."""
from setuptools import find_packages, setup

setup(
    name="elastictk",
    version="0.1.0",
    description="Fault-tolerant, elastic distributed PyTorch training: stores, rendezvous, "
    "supervisor, watchdog timers, metrics and fault injection",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["elastictk", "elastictk.*", "bench", "bench.*"]),
    install_requires=[
        # torch is deliberately unpinned here: the Makefile installs the exact CPU wheel first,
        # and any installed torch >= 2.4 satisfies this without pip resolving a new one.
        "torch>=2.4",
        "psutil>=5.9",
        "prometheus-client>=0.17",
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6.80", "pytest-timeout>=2.1"],
    },
    entry_points={"console_scripts": [
        "elastictk-run = elastictk.run:console_main",
        "elastictk-chaos = elastictk.chaos.cli:console_main",
    ]},
)
