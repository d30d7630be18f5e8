"""What a model's KV looks like: geometry, dtype, fingerprint, presets, config.json, sizes. Pure, no I/O
beyond reading a config file; `spec.py` is at the bottom and imports nothing above it."""
