"""The MARS core: pure torch + transformers, no Ray, no I/O. Training and serving both call it."""
