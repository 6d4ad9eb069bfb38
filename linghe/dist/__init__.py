"""Expert parallelism: the dispatcher and collective helpers."""
