"""exatrain."""
