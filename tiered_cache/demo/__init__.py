"""`tiered-cache demo`: two instances, one store, one long document (see `runner.py`)."""
