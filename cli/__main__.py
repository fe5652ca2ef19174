"""`python -m agentspec_sim.cli` runs the command line."""

from agentspec_sim.cli.app import main

main()
