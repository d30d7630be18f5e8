"""tiered-cache as SGLang's HiCache storage backend (`backend.TieredCacheStorage`). Importing this
package is free; `backend.py` imports SGLang."""
