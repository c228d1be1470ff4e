"""Data shipped with unimem: real prompts for tests, validation and benchmarks
(:mod:`unimem.data.prompts`). Imports nothing from unimem."""
