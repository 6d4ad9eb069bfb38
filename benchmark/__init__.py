"""linghe's benchmark: ``python -m benchmark [--case NAME ...] [--quick] [--json PATH]``."""
