"""The model-based drafters, `eagle3`, `mtp` and vLLM's `draft_model`: a seeded, calibrated acceptance model
(rule.py), its compiled path (fastpath.py), its fitting (calibrate.py) and the bundled parameter files (acceptance/).
docs/model-based-drafters.md has the model and its sources."""

# The methods this family registers → the module of the package that defines each (drafters/registry.py loads
# it when one of them is first asked for).
METHODS = {"eagle3": "rule", "mtp": "rule", "draft_model": "rule"}
