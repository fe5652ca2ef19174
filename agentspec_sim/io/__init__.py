"""Files in and out: strict JSON parsing, the output policy (no output destroys a file) and atomic writes."""
