"""What a consumer of releases runs on its own machine: a verified local folder per release,
kept by its release.json digest (`reg fetch-release`), and the same release laid out in the
Hugging Face hub cache (`reg fetch-release --hf`), so `from_pretrained(NAME,
local_files_only=True)` loads it offline.

Written once, in terms of the `Registry` calls every registry answers (`show`, `pull_release`):
the embedded registry and `reg server`'s client get the same caches. Nothing here runs in the
server.

    fetch.py           the entry point: resolve the ref, pick the cache
    common.py          the release a ref names now; a pull bound to its digest; swaps, locks
    release_cache.py   REG_CACHE_DIR/releases/MODEL/SHA256/ and its completion record
    hf_cache.py        HF_HUB_CACHE/models--MODEL/{blobs,snapshots,refs}
"""
