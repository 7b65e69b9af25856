"""Developer tooling that the runtime never imports (ahead-of-time compilation of the kernels)."""
