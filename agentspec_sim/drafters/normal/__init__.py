"""`normal`: no speculation, the baseline every speedup divides by."""

# The methods this family registers → the module of the package that defines each (drafters/registry.py loads
# it when one of them is first asked for).
METHODS = {"normal": "rule"}
