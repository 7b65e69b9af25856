"""Drop-in loss classes for sentence-transformers and open_clip (import the submodule you need)."""
