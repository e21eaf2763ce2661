"""One-off scripts of the project (corpus building, shipping the demo, stub generation): not installed."""
