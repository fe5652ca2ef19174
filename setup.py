"""Package discovery (the rest of the build is pyproject.toml): every package under agentspec_sim/, so a new
drafter family is installed without a line here, plus the top-level folders installed under agentspec_sim."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["agentspec_sim", "agentspec_sim.*"]),
                "agentspec_sim.cli", "agentspec_sim.traces", "agentspec_sim.validation"])
