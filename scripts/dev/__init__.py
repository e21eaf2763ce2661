"""Developer measurements and one-off diagnostics (memory, transport, TP loading, the demo's profile)."""
