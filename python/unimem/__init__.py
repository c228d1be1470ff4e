"""unimem: one memory arena for hybrid LLM serving (FULL + SWA + recurrent state)."""
