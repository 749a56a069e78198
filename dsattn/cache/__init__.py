"""Cache pytrees and formats."""
