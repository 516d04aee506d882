"""Schedule families. Each module registers its names on import."""
