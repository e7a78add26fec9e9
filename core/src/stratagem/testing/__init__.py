"""stratagem's pytest plugin and helpers for certifying strategies (the contract suite)."""
